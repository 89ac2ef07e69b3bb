"""HunyuanVideo cut into pipeline layers: embedders + token refiner, each double-stream block, each
single-stream block, final norm/projection.

What flows between layers (a tuple of tensors; every float tensor is used by the next layer):

- into the first layer: ``(x_t (B, C, F, H, W), t, text_embeds, text_mask, clip_pooled, guidance)``
- between blocks: ``(img_tokens, txt_tokens, temb, rope_cos, rope_sin, attention_mask, grid)``. The rotary
  embedding is computed once, by the first layer, and carried; ``attention_mask`` (bool) hides the text
  padding; ``grid`` (int) holds the latent frames/height/width after patching, for the final un-patching.
- the last single block drops what the final layer does not need: ``(img_tokens, temb, grid)``
- out of the final layer: ``(prediction (B, C, F, H, W),)`` in float32.

The layers wrap the model's own submodules and call them as ``HunyuanVideoTransformer3DModel.forward`` does,
so a pipeline of these layers computes the same function as the diffusers model.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Patch embedding, timestep (+ guidance) and pooled-CLIP embedding, the text token refiner, rotary
    embedding and the joint attention mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_text_embed, self.rope = model.time_text_embed, model.rope
        self.has_guidance = bool(model.config.guidance_embeds)
        self.patch = (int(model.config.patch_size_t), int(model.config.patch_size), int(model.config.patch_size))

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask, pooled, guidance = inputs
        dtype = self.x_embedder.proj.weight.dtype
        timestep = (t * 1000).to(dtype)  # the pipeline's scheduler timesteps are in [0, 1000]
        guidance_in = (guidance * 1000).to(dtype) if self.has_guidance else None
        cos, sin = self.rope(x)
        temb, _ = self.time_text_embed(timestep, pooled.to(dtype), guidance_in)
        img = self.x_embedder(x.to(dtype)).contiguous()  # a transposed view; stage boundaries send contiguous
        txt = self.context_embedder(text.to(dtype), timestep, text_mask)
        # joint mask as in the diffusers forward: image tokens, then the caption's real tokens, padding hidden
        n_img, n_txt = img.shape[1], txt.shape[1]
        valid = n_img + text_mask.sum(dim=1, dtype=torch.int)
        mask = (torch.arange(n_img + n_txt, device=img.device)[None] < valid[:, None])[:, None, None]
        pt, p, _ = self.patch
        grid = torch.tensor([x.shape[2] // pt, x.shape[3] // p, x.shape[4] // p], device=img.device)
        return img, txt, temb, cos, sin, mask, grid


class DoubleBlockLayer(WrappedBlock):
    """A double-stream block; the last of a model without single-stream blocks (HunyuanVideo-1.5) hands the final
    layer only ``(img_tokens, temb, grid)``."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, cos, sin, mask, grid = inputs
        img, txt = self.block(img, txt, temb, mask, (cos, sin))
        return (img, temb, grid) if self.last else (img, txt, temb, cos, sin, mask, grid)


class SingleBlockLayer(WrappedBlock):
    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, cos, sin, mask, grid = inputs
        img, txt = self.block(img, txt, temb, mask, (cos, sin))
        # the block returns slices of one tensor; a pipeline stage boundary can only send contiguous tensors
        img, txt = img.contiguous(), txt.contiguous()
        return (img, temb, grid) if self.last else (img, txt, temb, cos, sin, mask, grid)


class FinalLayer(OutputHead):
    """The final adaptive norm and projection, un-patched over the ``grid`` of ``(frames, height, width)`` (a video
    transformer: ``patch_size_t`` and ``patch_size``) or ``(height, width)`` (an image one: ``patch_size`` a pair)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        p = model.config.patch_size
        video = not isinstance(p, (list, tuple))
        self.patch = (int(model.config.patch_size_t), int(p), int(p)) if video else tuple(int(x) for x in p)

    def forward(self, inputs: Tensors) -> Tensors:
        img, temb, grid = inputs
        out = self.proj_out(self.norm_out(img, temb))
        sizes = grid.tolist()
        n = len(sizes)
        # (B, *sizes, C, *patch) -> (B, C, size_0, patch_0, size_1, patch_1, ...) -> (B, C, *sizes x patch)
        out = out.reshape(out.shape[0], *sizes, -1, *self.patch)
        out = out.permute(0, n + 1, *(d for i in range(n) for d in (i + 1, n + 2 + i)))
        for i in reversed(range(n)):
            out = out.flatten(2 + 2 * i, 3 + 2 * i)
        return (out.float(),)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``HunyuanVideoTransformer3DModel`` (sharing its parameters)."""
    if model.config.image_condition_type is not None:
        raise ValueError(
            f"image_condition_type={model.config.image_condition_type!r} (image-to-video) is not supported by "
            "diffpipe-hunyuan; give a text-to-video HunyuanVideo transformer"
        )
    return stacked(model, EmbedLayer(model), "HunyuanVideo")


def stacked(model: nn.Module, embed: nn.Module, name: str) -> list[nn.Module]:
    """``embed``, each double-stream block, each single-stream block and the final layer of ``model`` (a ``name``
    transformer: HunyuanVideo, HunyuanImage-2.1)."""
    singles = list(model.single_transformer_blocks)
    if not singles:
        raise ValueError(f"a {name} transformer without single-stream blocks is not supported by the layer split")
    return [
        embed,
        *(DoubleBlockLayer(b) for b in model.transformer_blocks),
        *(SingleBlockLayer(b, last=i == len(singles) - 1) for i, b in enumerate(singles)),
        FinalLayer(model),
    ]
