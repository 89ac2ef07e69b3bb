"""FLUX.3 cut into pipeline layers: embedders (input projections, the per-mode timestep modulations, the rotary
tables), each text mode block, each image mode block, each joint single block, the output norm/projection.

What flows between layers (a tuple of tensors; every float tensor is used by a later layer):

- into the first layer: ``(x, t, text, text_valid, grid)`` and, for a flow map (the step-distilled checkpoint), the
  target time ``target_t``: ``x`` ``(B, N, C)`` the noisy patch tokens row by row, ``t`` ``(B,)`` in [0, 1], ``text``
  ``(B, L, layers x d)`` the stacked Qwen3-VL states, ``text_valid`` ``(B, L)`` bool: True inside each caption's own
  text window (its padding included: the transformer attends to it), ``grid`` ``(2,)`` int: the patch grid's
  ``(h, w)``
- between blocks: ``(img, txt, temb, [txt_early,] [img_early,] txt_single, img_single, img_cos, img_sin, txt_cos,
  txt_sin, key_valid)``: the per-mode modulations ``(B, 1, 3D)`` (the last text / image mode block drops its own),
  the image's time embedding ``(B, 1, D)`` (the output layer's), ``key_valid`` the text keys' mask, or ``(B, 1)``
  when every caption fills the window (no mask: the pipeline's own path)
- the last joint block hands on ``(img, temb)``; out of the final layer: ``(prediction,)`` ``(B, N, C)`` float32

The layers call the model's own submodules as ``Flux3Transformer2DModel.forward`` does (modulations of one row per
sample, which the forward computes per token and alike for every token), so a pipeline of them computes the same
function as the diffusers model. Captions of different windows in one micro-batch: each caption's keys beyond its
window are masked, which is the forward on each caption alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]
#: the pipeline's image position-id scale (``Flux3PrepareLatentsStep.image_rope_scale``)
IMAGE_ROPE_SCALE = 0.5


def image_ids(h: int, w: int, device: torch.device | None = None) -> torch.Tensor:
    """``(h * w, 4)`` ids ``(0, row / 2, col / 2, 0)`` of the image patches (``_prepare_image_ids``)."""
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, cols, zeros], dim=1).float() * torch.tensor([1, IMAGE_ROPE_SCALE,
                                                                                   IMAGE_ROPE_SCALE, 1], device=device)


def text_ids(n: int, device: torch.device | None = None) -> torch.Tensor:
    """``(n, 4)`` ids ``(0, 0, 0, i)`` of the text tokens (``_prepare_text_ids``)."""
    ids = torch.zeros(n, 4, device=device)
    ids[:, 3] = torch.arange(n, device=device)
    return ids


def compute_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear computes in (a quantized file's linear stores its weight in another)."""
    return getattr(linear, "compute_dtype", linear.weight.dtype)


class Flux3EmbedLayer(nn.Module):
    """Input projections, the image's and the text's time embeddings and their modulations (the text at time 0; a
    flow map adds the target time's embedding to both), the rotary tables, the text keys' mask. It also holds the
    reference-image mode's modules, which text-to-image training never runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedders["image"], model.context_embedder
        self.time_proj, self.timestep_embedder = model.time_proj, model.timestep_embedder
        self.target_timestep_embedder = model.target_timestep_embedder
        early, single = model.early_stream_modulations, model.single_stream_modulations
        self.txt_early, self.img_early, self.txt_single, self.img_single = (
            early["txt"], early["image"], single["txt"], single["image"])
        # the reference-image mode's parts: held (loaded, saved, exported with the model), never run by
        # text-to-image training, so they keep their weights
        self.reference_mode = nn.ModuleList([model.x_embedders["image_cond"], model.mode_blocks["image_cond"],
                                             early["image_cond"], single["image_cond"]])
        self.pos_embed = model.pos_embed

    def embed_time(self, embedder: nn.Module, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return embedder(self.time_proj(t.to(dtype) * 1000).to(dtype))[:, None, :]

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_valid, grid = inputs[:5]
        dtype = compute_dtype(self.x_embedder)
        x = x.to(dtype)
        temb = self.embed_time(self.timestep_embedder, t, dtype)
        zero = self.embed_time(self.timestep_embedder, torch.zeros_like(t), dtype)
        if self.target_timestep_embedder is not None:
            target = self.embed_time(self.target_timestep_embedder, inputs[5], dtype)
            temb, zero = temb + target, zero + target
        zero_act, temb_act = F.silu(zero), F.silu(temb)
        txt = self.context_embedder(text.to(dtype))
        img = self.x_embedder(x)
        h, w = (int(v) for v in grid.tolist())
        img_cos, img_sin = self.pos_embed(image_ids(h, w, img.device))
        txt_cos, txt_sin = self.pos_embed(text_ids(txt.shape[1], txt.device))
        text_valid = text_valid.bool()
        key_valid = text_valid if not bool(text_valid.all()) else text_valid[:, :1]
        return (img, txt, temb, self.txt_early(zero_act), self.img_early(temb_act), self.txt_single(zero_act),
                self.img_single(temb_act), img_cos, img_sin, txt_cos, txt_sin, key_valid)


def key_mask(key_valid: torch.Tensor, text_len: int, image_len: int = 0) -> torch.Tensor | None:
    """The attention mask ``(B, 1, 1, text_len + image_len)`` of the text keys beyond each caption's window (image
    keys all valid); None when every caption fills the window."""
    if key_valid.shape[1] != text_len or text_len == 1:
        return None
    if image_len:
        key_valid = torch.cat([key_valid, key_valid.new_ones(key_valid.shape[0], image_len)], dim=1)
    return key_valid[:, None, None, :]


def masked_block(block: nn.Module, x: torch.Tensor, mod: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
    """A block's parallel attention + feedforward on modulated ``x`` (``Flux3ModeTransformerBlock.forward``) with the
    attention ``mask``."""
    shift, scale, gate = torch.chunk(mod, 3, dim=-1)
    normed = (1 + scale) * block.norm(x) + shift
    return x + gate * (block.attn(hidden_states=normed, attention_mask=mask, image_rotary_emb=rope) + block.ff(normed))


class Flux3TextModeLayer(WrappedBlock):
    """One text mode block (self-attention over the text alone, the padding beyond a caption's window masked)."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, txt_early, *rest = inputs
        txt_cos, txt_sin, key_valid = rest[-3:]
        rope = (txt_cos, txt_sin)
        mask = key_mask(key_valid, txt.shape[1])
        txt = self.block(txt, txt_early, rope) if mask is None else masked_block(self.block, txt, txt_early, rope, mask)
        return (img, txt, temb, *rest) if self.last else (img, txt, temb, txt_early, *rest)


class Flux3ImageModeLayer(WrappedBlock):
    """One image mode block (self-attention over the image tokens alone)."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, img_early, txt_single, img_single, img_cos, img_sin, *rest = inputs
        img = self.block(img, img_early, (img_cos, img_sin))
        kept = (txt_single, img_single, img_cos, img_sin, *rest)
        return (img, txt, temb, *kept) if self.last else (img, txt, temb, img_early, *kept)


class Flux3SingleLayer(WrappedBlock):
    """One joint block over ``[text, image]``, each with its own modulation."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, txt_single, img_single, img_cos, img_sin, txt_cos, txt_sin, key_valid = inputs
        rope = (torch.cat([txt_cos, img_cos]), torch.cat([txt_sin, img_sin]))
        mask = key_mask(key_valid, txt.shape[1], img.shape[1])
        if mask is None:
            txt, img = self.block(hidden_states=img, encoder_hidden_states=txt, temb_mod=img_single,
                                  temb_mod_context=txt_single, image_rotary_emb=rope)
        else:
            txt, img = masked_single(self.block, img, txt, img_single, txt_single, rope, mask)
        if self.last:
            return img, temb
        return img, txt, temb, txt_single, img_single, img_cos, img_sin, txt_cos, txt_sin, key_valid


def masked_single(block: nn.Module, img, txt, img_mod, txt_mod, rope, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``Flux3SingleTransformerBlock.forward`` with the attention ``mask``: ``(txt, img)``."""
    shift, scale, gate = torch.chunk(img_mod, 3, dim=-1)
    c_shift, c_scale, c_gate = torch.chunk(txt_mod, 3, dim=-1)
    joint = torch.cat([(1 + c_scale) * block.norm(txt) + c_shift, (1 + scale) * block.norm(img) + shift], dim=1)
    out = block.attn(hidden_states=joint, attention_mask=mask, image_rotary_emb=rope) + block.ff(joint)
    return txt + c_gate * out[:, : txt.shape[1]], img + gate * out[:, txt.shape[1] :]


class Flux3FinalLayer(OutputHead):
    """The output adaptive layer norm (the image's time embedding) and projection of the image tokens."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, temb = inputs
        return (self.proj_out(self.norm_out(img, temb)).float(),)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``Flux3Transformer2DModel`` (sharing its parameters)."""
    text, image = list(model.txt_mode_blocks), list(model.mode_blocks["image"])
    single = list(model.single_transformer_blocks)
    if not (text and single):
        raise ValueError("a FLUX.3 transformer without mode blocks or joint blocks is not supported by diffpipe-flux")
    return [
        Flux3EmbedLayer(model),
        *(Flux3TextModeLayer(b, last=i == len(text) - 1) for i, b in enumerate(text)),
        *(Flux3ImageModeLayer(b, last=i == len(image) - 1) for i, b in enumerate(image)),
        *(Flux3SingleLayer(b, last=i == len(single) - 1) for i, b in enumerate(single)),
        Flux3FinalLayer(model),
    ]
