"""The Cosmos transformer cut into pipeline layers: embedding, each transformer block, final norm/projection.

What flows between layers (a tuple of tensors; every float tensor is used by a later layer):

- into the first layer: ``(x (B, C, T, H, W), timestep (B,), t5_embeds (B, L, D))``; video-to-world
  (``[model] conditioning = "video"``): ``x`` with the condition mask as its last channel ``(B, C + 1, T, H, W)``
  and, for Predict2, per-frame timesteps ``(B, 1, T, 1, 1)``
- between blocks: ``(tokens, text, embedded_timestep, temb, rope_cos, rope_sin[, extra_pos], grid)``;
  ``extra_pos`` only for models with a learnable position embedding (Cosmos-1.0), ``grid`` = the int64
  post-patch sizes ``(T', H', W')`` the final layer needs to unpatchify
- the last block passes on only ``(tokens, embedded_timestep, temb, grid)``
- out of the final layer: ``(prediction (B, C, T, H, W),)`` in float32.

The layers wrap the model's own submodules and call them as ``CosmosTransformer3DModel.forward`` does, with an
all-zero padding mask (no padded pixels; the pipelines pass zeros too, so its nearest resize to the latent grid,
diffusers' one torchvision call, is zeros as well) and, for models whose ``in_channels`` has one more channel than
the output (video-to-world) and an ``x`` without it, an all-zero condition mask (no conditioning frames).
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Masks, RoPE, learnable position embedding, patch embedding and timestep embedding."""

    def __init__(self, model: nn.Module, fps: float | None) -> None:
        super().__init__()
        self.patch_embed, self.rope, self.time_embed = model.patch_embed, model.rope, model.time_embed
        self.learnable_pos_embed = model.learnable_pos_embed
        self.crossattn_proj = getattr(model, "crossattn_proj", None)
        config = model.config
        self.patch_size, self.max_size, self.fps = tuple(config.patch_size), tuple(config.max_size), fps
        self.channels = int(config.in_channels) + int(config.concat_padding_mask)  # channels the patch embed takes

    def forward(self, inputs: Tensors) -> Tensors:
        x, timestep, text = inputs
        b, _, t, h, w = x.shape
        if t > self.max_size[0] or h > self.max_size[1] or w > self.max_size[2]:
            raise ValueError(
                f"latents of {t}x{h}x{w} (frames x height x width) exceed the transformer's max_size "
                f"{'x'.join(map(str, self.max_size))} (transformer/config.json); use smaller sizes or fewer frames"
            )
        dtype = self.patch_embed.proj.weight.dtype
        x = torch.cat([x.to(dtype), x.new_zeros(b, self.channels - x.shape[1], t, h, w, dtype=dtype)], dim=1)
        cos, sin = self.rope(x, fps=self.fps if t > 1 else None)
        extra = (self.learnable_pos_embed(x),) if self.learnable_pos_embed is not None else ()
        p_t, p_h, p_w = self.patch_size
        grid = torch.tensor([t // p_t, h // p_h, w // p_w], dtype=torch.long)
        tokens = self.patch_embed(x).flatten(1, 3)
        if timestep.dim() == 5:  # per latent frame (video-to-world), as CosmosTransformer3DModel.forward spreads it
            temb, embedded = self.time_embed(tokens, timestep.flatten().to(dtype))
            temb, embedded = (
                v.view(b, int(grid[0]), 1, 1, -1).expand(-1, -1, int(grid[1]), int(grid[2]), -1).flatten(1, 3)
                for v in (temb, embedded)
            )
        else:
            temb, embedded = self.time_embed(tokens, timestep.to(dtype))
        text = text.to(dtype)
        if self.crossattn_proj is not None:
            text = self.crossattn_proj(text)
        return (tokens, text, embedded, temb, cos, sin, *extra, grid)


class BlockLayer(WrappedBlock):
    def forward(self, inputs: Tensors) -> Tensors:
        tokens, text, embedded, temb, cos, sin, *extra, grid = inputs
        tokens = self.block(tokens, text, embedded, temb, (cos, sin), extra[0] if extra else None, None)
        return (tokens, embedded, temb, grid) if self.last else (tokens, text, embedded, temb, cos, sin, *extra, grid)


class FinalLayer(OutputHead):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.patch_size = tuple(model.config.patch_size)

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, embedded, temb, grid = inputs
        p_t, p_h, p_w = self.patch_size
        t, h, w = (int(v) for v in grid)
        x = self.proj_out(self.norm_out(tokens, embedded, temb))
        # the unpatchify of CosmosTransformer3DModel.forward (its permutation is not the patchify's inverse)
        x = x.unflatten(2, (p_h, p_w, p_t, -1)).unflatten(1, (t, h, w))
        x = x.permute(0, 7, 1, 6, 2, 4, 3, 5).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        return (x.float(),)


def split_into_layers(model: nn.Module, fps: float | None) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``CosmosTransformer3DModel`` (sharing its parameters)."""
    blocks = list(model.transformer_blocks)
    if not blocks:
        raise ValueError("a Cosmos transformer without transformer_blocks cannot be split into pipeline layers")
    if model.config.controlnet_block_every_n or model.config.img_context_dim_in:
        raise ValueError("Cosmos transformers with control or image-context inputs (Transfer/2.5) are not supported")
    return [
        EmbedLayer(model, fps),
        *(BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
        FinalLayer(model),
    ]
