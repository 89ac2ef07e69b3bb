"""diffusers' ``HiDreamImageTransformer2DModel`` cut into pipeline layers: the embedders, one layer per double-stream
block, one per single-stream block (each with its MoE feed-forward and its Llama layer's caption projection), the
output head.

What flows between layers (a tuple of tensors):

- into the first layer: ``(x_t (B, C, H, W), t (B,), t5 (B, L, d5), llama (B, layers, L, dL), pooled (B, P))``;
  ``t`` is the flow time (1 = noise); the transformer is given ``1000 t``, the scheduler's timestep, as
  ``HiDreamImagePipeline`` gives it; ``llama`` is the stack of Llama's hidden states (``hidden_states[1:]``).
- between the layers, those of ``(tokens, text, llama, last_text, temb, rope, mask, size)`` a later layer reads, in
  that order (:data:`ORDER`; each layer is told which it takes and which it hands on): the image tokens (padded to the
  model's ``max_seq`` when the latents are not square, as the model pads them; after the last double-stream block,
  the image and text tokens in one stream), the text stream of the double-stream blocks (T5's and the last Llama
  layer's projected tokens), the Llama stack (until the last block that projects its own layer), the last Llama
  layer's projection (the last block reads it too), the timestep + pooled embedding, the rotary table, the key mask
  (ones for square latents: no padding), ``size`` = ``(H, W, image tokens)`` (int).
- out of the head: ``(velocity (B, C, H, W),)`` float32: the transformer's output negated, which is what
  ``HiDreamImagePipeline`` hands its scheduler (``noise_pred = -noise_pred``), i.e. ``noise - x``.

A pipeline of these layers computes ``HiDreamImageTransformer2DModel.forward`` (in eval mode; a test checks it). In
training mode the MoE feed-forward takes diffusers' differentiable routing path; its gate's auxiliary loss is
computed by diffusers and dropped by its forward (see the README).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock

Tensors = tuple[torch.Tensor, ...]


def _llama_layer(llama: torch.Tensor, index: int, dtype: torch.dtype) -> torch.Tensor:
    return llama[:, index].to(dtype)


#: the names of what flows between layers, in the order the tuples hold them
ORDER = ("tokens", "text", "llama", "last_text", "temb", "rope", "mask", "size")


class _Named(nn.Module):
    """A layer taking the named tensors ``takes`` (in :data:`ORDER`) and handing on ``hands``."""

    takes: tuple[str, ...] = ORDER
    hands: tuple[str, ...] = ORDER

    def wire(self, takes: tuple[str, ...], hands: tuple[str, ...]) -> _Named:
        self.takes, self.hands = takes, hands
        return self

    def named(self, inputs: Tensors) -> dict[str, torch.Tensor]:
        return dict(zip(self.takes, inputs, strict=True))

    def handed(self, state: dict[str, torch.Tensor]) -> Tensors:
        return tuple(state[name] for name in self.hands)


class EmbedLayer(_Named):
    """Patchify (padding non-square latents as the model does), the patch, timestep and pooled embeddings, the T5 and
    last-Llama-layer caption projections that start the text stream, the rotary table."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from diffusers import HiDreamImageTransformer2DModel

        self.x_embedder, self.t_embedder, self.p_embedder = model.x_embedder, model.t_embedder, model.p_embedder
        self.pe_embedder = model.pe_embedder
        self.t5_projection, self.last_projection = model.caption_projection[-1], model.caption_projection[-2]
        self.last_layer = int(model.config.llama_layers[-1])
        # diffusers' own patchify reads only these two of the model
        self._shape = SimpleNamespace(config=SimpleNamespace(patch_size=int(model.config.patch_size)),
                                      max_seq=int(model.max_seq))
        self._patchify = HiDreamImageTransformer2DModel.patchify

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, t5, llama, pooled = inputs
        dtype = self.x_embedder.proj.bias.dtype  # the compute dtype (a quantized file's weights are stored otherwise)
        b, _, h, w = x.shape
        tokens, mask, _, img_ids = self._patchify(self._shape, x.to(dtype))
        image_len = tokens.shape[1]
        if mask is None:  # square latents: no padding, every key counts
            mask = tokens.new_ones(b, image_len)
        temb = self.t_embedder(t.float() * 1000, dtype) + self.p_embedder(pooled.to(dtype))
        last_text = self.last_projection(_llama_layer(llama, self.last_layer, dtype))
        text = torch.cat([self.t5_projection(t5.to(dtype)), last_text], dim=1)
        txt_ids = img_ids.new_zeros(b, text.shape[1] + last_text.shape[1], 3)
        rope = self.pe_embedder(torch.cat([img_ids, txt_ids], dim=1))
        size = torch.tensor([h, w, image_len], dtype=torch.long, device=x.device)
        return self.handed({"tokens": self.x_embedder(tokens), "text": text, "llama": llama, "last_text": last_text,
                            "temb": temb, "rope": rope, "mask": mask, "size": size})


def _moe_volume(ff: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MoE feed-forward with every token through its ``num_activated_experts`` first experts, weighted by the
    gate: the activations diffusers' routing keeps (each token through that many experts), without the
    data-dependent indexing the meta device cannot run."""
    _, weight, _ = ff.gate(x)
    flat = x.reshape(-1, x.shape[-1])
    y = sum(ff.experts[j](flat) * weight[:, j : j + 1] for j in range(ff.num_activated_experts))
    return y.view(x.shape) + ff.shared_experts(x)


@contextmanager
def _measurable(block: nn.Module, meta: bool) -> Iterator[None]:
    """On the meta device (the GPU-fit table's activation measurement, ``diffpipe_core.engine.activations``) the
    block's MoE feed-forward runs as :func:`_moe_volume`; elsewhere, as itself."""
    ff = getattr(block, "ff_i", None)
    if not meta or not hasattr(ff, "gate"):
        yield
        return
    ff.forward = lambda x: _moe_volume(ff, x)
    try:
        yield
    finally:
        del ff.forward


class _BlockLayer(WrappedBlock, _Named):
    """A block with the caption projection of its Llama layer (None: the last block, which reads ``last_text``)."""

    def __init__(self, block: nn.Module, projection: nn.Module | None, llama_layer: int, last: bool = False) -> None:
        super().__init__(block, last)
        self.projection, self.llama_layer = projection, llama_layer

    def own_text(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.projection is None:
            return state["last_text"]
        return self.projection(_llama_layer(state["llama"], self.llama_layer, state["tokens"].dtype))


class DoubleLayer(_BlockLayer):
    """One double-stream block on the image tokens and ``[text, this block's Llama layer projected]``; the last one
    joins the image and text tokens into the single stream."""

    def forward(self, inputs: Tensors) -> Tensors:
        state = self.named(inputs)
        own, text = self.own_text(state), state["text"]
        with _measurable(self.block.block, own.is_meta):
            tokens, text_out = self.block(hidden_states=state["tokens"], hidden_states_masks=state["mask"],
                                          encoder_hidden_states=torch.cat([text, own], dim=1), temb=state["temb"],
                                          image_rotary_emb=state["rope"])
        state.update(tokens=tokens, text=text_out[:, : text.shape[1]])
        if self.last:
            mask = state["mask"]
            state["mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], text.shape[1] + own.shape[1])], dim=1)
            state["tokens"] = torch.cat([tokens, state.pop("text")], dim=1)
        return self.handed(state)


class SingleLayer(_BlockLayer):
    """One single-stream block on ``[image, text, this block's Llama layer projected]``, keeping the stream's
    length."""

    def forward(self, inputs: Tensors) -> Tensors:
        state = self.named(inputs)
        tokens = state["tokens"]
        with _measurable(self.block.block, tokens.is_meta):
            out = self.block(hidden_states=torch.cat([tokens, self.own_text(state)], dim=1),
                             hidden_states_masks=state["mask"], encoder_hidden_states=None, temb=state["temb"],
                             image_rotary_emb=state["rope"])
        state["tokens"] = out[:, : tokens.shape[1]]
        return self.handed(state)


class FinalLayer(_Named):
    """The image tokens through the final adaLN norm and projection, unpatchified to ``(B, C, H, W)``, negated."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.final_layer = model.final_layer
        self.patch, self.channels = int(model.config.patch_size), int(model.out_channels)

    def forward(self, inputs: Tensors) -> Tensors:
        state = self.named(inputs)
        h, w, image_len = (int(v) for v in state["size"].tolist())
        out = self.final_layer(state["tokens"][:, :image_len], state["temb"])
        p, b = self.patch, out.shape[0]
        out = out[:, : (h // p) * (w // p)].reshape(b, h // p, w // p, p, p, self.channels)
        out = out.permute(0, 5, 1, 3, 2, 4).reshape(b, self.channels, h, w)
        return (-out.float(),)


def _reads(layer: nn.Module) -> set[str]:
    """The names ``layer`` reads."""
    if isinstance(layer, FinalLayer):
        return {"tokens", "temb", "size"}
    own = {"last_text"} if layer.projection is None else {"llama"}
    return {"tokens", "temb", "rope", "mask", *own, *({"text"} if isinstance(layer, DoubleLayer) else ())}


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``HiDreamImageTransformer2DModel`` (sharing its parameters). Block
    ``k`` (double-stream blocks first) reads Llama layer ``llama_layers[k]`` through ``caption_projection[k]``; the
    last block's projection is the embedding layer's (it also starts the text stream), so that block reads its
    output. Each layer hands on only what a later layer reads."""
    doubles, singles = list(model.double_stream_blocks), list(model.single_stream_blocks)
    if not doubles:
        raise ValueError("a HiDream transformer without double-stream blocks is not supported")
    layers_of = [int(k) for k in model.config.llama_layers]
    count = len(doubles) + len(singles)
    if len(layers_of) != count:
        raise ValueError(f"transformer config: llama_layers has {len(layers_of)} entries for {count} blocks")

    def projection(k: int) -> nn.Module | None:
        return None if k == count - 1 else model.caption_projection[k]

    blocks: list[nn.Module] = [DoubleLayer(b, projection(i), layers_of[i], last=i == len(doubles) - 1)
                               for i, b in enumerate(doubles)]
    blocks += [SingleLayer(b, projection(len(doubles) + j), layers_of[len(doubles) + j]) for j, b in enumerate(singles)]
    layers: list[_Named] = [EmbedLayer(model), *blocks, FinalLayer(model)]
    takes: tuple[str, ...] = ()
    for i, layer in enumerate(layers):
        later = set().union(*(_reads(x) for x in layers[i + 1 :]))
        made = set(ORDER) - ({"text"} if isinstance(layer, DoubleLayer) and layer.last else set())
        hands = tuple(n for n in ORDER if n in later and n in made) if i < len(layers) - 1 else ()
        layer.wire(takes, hands)
        takes = hands
    return layers
