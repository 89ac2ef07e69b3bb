"""The diffusion model of {{name}}:
a tiny MMDiT built from diffusers' parts (SD3's joint blocks), as a diffusers ``ModelMixin`` + ``ConfigMixin``, so
``save_pretrained`` / ``from_config`` / ``from_pretrained`` work on it and its folder (``transformer/config.json``,
``diffusion_pytorch_model.safetensors``) is a diffusers one.

Replace it with your model's code; when diffusers has the architecture, delete this module and name the class in
``plugin.py`` instead (``"transformer": "QwenImageTransformer2DModel"``).

Latents are ``(B, C, H, W)`` images or ``(B, C, F, H, W)`` videos; each frame is cut into ``patch_size`` squares
with fixed 3-D sin-cos positions. The text tokens and the latent tokens attend jointly in every block; the text
stream's output of the last block is read by nothing (``plugin.py`` leaves its linears out of the LoRA targets).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.embeddings import TimestepEmbedding, Timesteps, get_3d_sincos_pos_embed
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormContinuous
from torch import nn


class PatchEmbed(nn.Module):
    """``(B, C, [F,] H, W)`` latents -> ``(B, F * H/p * W/p, dim)`` tokens with their sin-cos positions."""

    def __init__(self, in_channels: int, patch_size: int, dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Linear(in_channels * patch_size**2, dim)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = latents if latents.dim() == 5 else latents.unsqueeze(2)
        b, c, f, h, w = x.shape
        p = self.patch_size
        x = x.reshape(b, c, f, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6).reshape(b, -1, c * p * p)
        pos = get_3d_sincos_pos_embed(self.proj.out_features, (w // p, h // p), f, device=x.device)
        return self.proj(x) + pos.reshape(1, -1, pos.shape[-1]).to(x.dtype)


class TimeEmbed(nn.Module):
    """Flow times ``t`` in (0, 1) -> the conditioning vector (embedded as ``1000 t``, as diffusers' models do)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.embedder = TimestepEmbedding(256, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.embedder(self.proj(t * 1000).to(self.embedder.linear_1.weight.dtype))


def unpatchify(tokens: torch.Tensor, size: list[int], patch_size: int, channels: int) -> torch.Tensor:
    """The inverse of :class:`PatchEmbed`'s cut: ``(B, N, p * p * C)`` -> ``(B, C, *size)`` (``size`` is
    ``[H, W]`` or ``[F, H, W]``, as the latents were)."""
    f, h, w = ([1] + size)[-3:]
    p = patch_size
    x = tokens.reshape(tokens.shape[0], f, h // p, w // p, channels, p, p).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(tokens.shape[0], channels, *size)


class TinyDiT(ModelMixin, ConfigMixin):
    """Patch and text embedders, ``num_layers`` joint attention blocks, an adaLN output head."""

    @register_to_config
    def __init__(
        self,
        in_channels: int = 4,
        patch_size: int = 2,
        num_layers: int = 2,
        num_attention_heads: int = 2,
        attention_head_dim: int = 16,
        text_dim: int = 32,
    ) -> None:
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.x_embedder = PatchEmbed(in_channels, patch_size, dim)
        self.context_embedder = nn.Linear(text_dim, dim)
        self.time_embed = TimeEmbed(dim)
        self.transformer_blocks = nn.ModuleList(
            JointTransformerBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)
        )
        self.norm_out = AdaLayerNormContinuous(dim, dim, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(dim, patch_size**2 * in_channels)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The velocity prediction for ``latents`` at times ``t`` given ``(B, L, text_dim)`` text embeddings."""
        tokens, context, temb = self.x_embedder(latents), self.context_embedder(text), self.time_embed(t)
        for block in self.transformer_blocks:
            context, tokens = block(tokens, context, temb)
        out = self.proj_out(self.norm_out(tokens, temb))
        return unpatchify(out, list(latents.shape[2:]), self.config.patch_size, self.config.in_channels)
