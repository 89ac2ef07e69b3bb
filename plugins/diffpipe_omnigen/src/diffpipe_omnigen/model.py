"""OmniGen2's diffusion transformer, written for diffpipe on diffusers' Lumina 2 building blocks.

OmniGen2 (VectorSpaceLab/OmniGen2) is not in diffusers. Its transformer is a Lumina-2 style single-stream DiT: caption
refiner blocks (no modulation), noise refiner blocks over the target image's patches, reference-image refiner blocks
over the input images' patches (each image tagged with a learned ``image_index_embedding``), then the main blocks
over ``[caption, reference images, target image]`` and an adaptive output norm. Its blocks, timestep/caption
embedding and output norm are exactly diffusers' ``Lumina2TransformerBlock``,
``Lumina2CombinedTimestepCaptionEmbedding`` (with OmniGen2's ``timestep_scale``) and ``LuminaLayerNormContinuous``;
the parameter names are the released checkpoint's (``transformer/diffusion_pytorch_model*.safetensors`` of
OmniGen2/OmniGen2, which ComfyUI's ``omnigen2_fp16.safetensors`` holds under the same names), so
``from_pretrained`` on the released folder loads it.

Time runs as in the reference: ``t = 0`` is noise, ``t = 1`` the image, and the model predicts ``image - noise``.
Positions are 3-axis rotary ids: caption token ``i`` is ``(i, i, i)``; each image's patches are ``(s, row, col)``
with ``s`` starting at the caption's length and growing by ``max(rows, cols)`` per reference image.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import LuminaLayerNormContinuous
from diffusers.models.transformers.transformer_lumina2 import (
    Lumina2CombinedTimestepCaptionEmbedding,
    Lumina2TransformerBlock,
)
from torch import nn

MAX_REFERENCE_IMAGES = 5  # rows of image_index_embedding


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``(C, H, W)`` -> ``(H/p * W/p, p * p * C)``, patches row by row, each ``(p1, p2, c)`` flattened."""
    c, h, w = x.shape
    return x.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0).reshape((h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, p: int, c: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: ``(h/p * w/p, p * p * c)`` -> ``(c, h, w)``."""
    return tokens.reshape(h // p, w // p, p, p, c).permute(4, 0, 2, 1, 3).reshape(c, h, w)


def rope_tables(axes_dim: tuple[int, ...], axes_lens: tuple[int, ...], theta: float = 10000.0) -> list[torch.Tensor]:
    """One complex table per rotary axis (float64 frequencies, as the reference pipeline's ``get_freqs_cis``)."""
    return [get_1d_rotary_pos_embed(d, e, theta=theta, freqs_dtype=torch.float64) for d, e in zip(axes_dim, axes_lens)]


def grid_ids(shift: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """``(rows * cols, 3)`` rotary ids of one image's patches: ``(shift, row, col)``."""
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    return torch.stack([torch.full_like(r, shift), r, c], dim=1)


def sample_ids(cap_len: int, ref_grids: list[tuple[int, int]], grid: tuple[int, int], device: torch.device):
    """The rotary ids of one sample's caption, reference images (concatenated) and target image."""
    cap = torch.arange(cap_len, device=device)[:, None].expand(cap_len, 3)
    shift, refs = cap_len, []
    for rows, cols in ref_grids:
        refs.append(grid_ids(shift, rows, cols, device))
        shift += max(rows, cols)
    ref = torch.cat(refs) if refs else cap.new_zeros(0, 3)
    return cap, ref, grid_ids(shift, *grid, device)


def rotary(tables: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The complex rotary factors of ``ids`` ``(..., 3)``: each axis's table row, concatenated."""
    return torch.cat([t.to(ids.device)[ids[..., i]] for i, t in enumerate(tables)], dim=-1)


def padded(rows: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths stacked, zero-padded at the end, with their ``(B, L)`` bool mask."""
    length = max(r.shape[0] for r in rows) if length is None else length
    out = rows[0].new_zeros(len(rows), length, *rows[0].shape[1:])
    mask = torch.zeros(len(rows), length, dtype=torch.bool, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]], mask[i, : r.shape[0]] = r, True
    return out, mask


class OmniGen2Transformer2DModel(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """OmniGen2's transformer (config keys and parameter names of the released ``transformer/config.json``)."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["Lumina2TransformerBlock"]
    _skip_layerwise_casting_patterns = ["x_embedder", "norm"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int | None = None,
        hidden_size: int = 2520,
        num_layers: int = 32,
        num_refiner_layers: int = 2,
        num_attention_heads: int = 21,
        num_kv_heads: int = 7,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: tuple[int, int, int] = (40, 40, 40),
        axes_lens: tuple[int, int, int] = (10000, 10000, 10000),
        text_feat_dim: int = 2048,
        timestep_scale: float = 1000.0,
    ) -> None:
        super().__init__()
        if hidden_size // num_attention_heads != sum(axes_dim_rope):
            raise ValueError(f"hidden_size // num_attention_heads ({hidden_size // num_attention_heads}) must equal "
                             f"sum(axes_dim_rope) ({sum(axes_dim_rope)})")
        self.out_channels = out_channels or in_channels
        patch = patch_size * patch_size * in_channels
        self.x_embedder = nn.Linear(patch, hidden_size)
        self.ref_image_patch_embedder = nn.Linear(patch, hidden_size)
        self.time_caption_embed = Lumina2CombinedTimestepCaptionEmbedding(hidden_size, text_feat_dim, norm_eps=norm_eps)
        self.time_caption_embed.time_proj.scale = timestep_scale  # the reference's Timesteps(scale=timestep_scale)

        def blocks(n: int, modulation: bool = True) -> nn.ModuleList:
            return nn.ModuleList(
                Lumina2TransformerBlock(hidden_size, num_attention_heads, num_kv_heads, multiple_of,
                                        ffn_dim_multiplier, norm_eps, modulation=modulation)
                for _ in range(n)
            )

        self.noise_refiner = blocks(num_refiner_layers)
        self.ref_image_refiner = blocks(num_refiner_layers)
        self.context_refiner = blocks(num_refiner_layers, modulation=False)
        self.layers = blocks(num_layers)
        self.norm_out = LuminaLayerNormContinuous(
            hidden_size, min(hidden_size, 1024), elementwise_affine=False, eps=1e-6, bias=True,
            out_dim=patch_size * patch_size * self.out_channels,
        )
        self.image_index_embedding = nn.Parameter(torch.zeros(MAX_REFERENCE_IMAGES, hidden_size))
        self.gradient_checkpointing = False

    def rope(self) -> list[torch.Tensor]:
        """The rotary tables of the config (computed on first use: no weight file holds them)."""
        if getattr(self, "_rope", None) is None:
            self._rope = rope_tables(tuple(self.config.axes_dim_rope), tuple(self.config.axes_lens))
        return self._rope

    def embed(self, timestep: torch.Tensor, text: torch.Tensor, dtype: torch.dtype):
        """``(temb, caption tokens)``: the timestep (``t = 1`` the image) and caption embeddings."""
        return self.time_caption_embed(text.new_zeros((), dtype=dtype), timestep, text)

    def refine_references(self, refs: list[list[torch.Tensor]], temb: torch.Tensor, freqs: list[torch.Tensor]):
        """Each sample's reference latents, patch-embedded, tagged with their index embedding and refined one image
        at a time (``freqs``: each sample's concatenated rotary factors); per sample ``(tokens, rows)``."""
        p, out = self.config.patch_size, []
        for i, images in enumerate(refs):
            parts, start = [], 0
            for j, image in enumerate(images):
                tokens = self.ref_image_patch_embedder(patchify(image, p)) + self.image_index_embedding[j]
                n = tokens.shape[0]
                x = tokens[None]
                for block in self.ref_image_refiner:
                    x = block(x, None, freqs[i][start : start + n][None], temb[i : i + 1])
                parts.append(x[0])
                start += n
            out.append(torch.cat(parts) if parts else temb.new_zeros(0, self.config.hidden_size))
        return out

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        text_hidden_states: torch.Tensor,
        text_attention_mask: torch.Tensor,
        ref_image_hidden_states: list[list[torch.Tensor] | None] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """``hidden_states`` ``(B, C, H, W)`` latents at time ``timestep`` ``(B,)`` (0 = noise), ``text_hidden_states``
        ``(B, L, text_feat_dim)`` with its right-padded ``text_attention_mask``, optionally each sample's reference
        latents ``(C, h, w)``: the predicted velocity ``image - noise`` ``(B, C, H, W)``."""
        p, dtype = self.config.patch_size, hidden_states.dtype
        b, c, h, w = hidden_states.shape
        temb, cap = self.embed(timestep, text_hidden_states, dtype)
        refs = [r or [] for r in (ref_image_hidden_states or [None] * b)]
        tables, mask = self.rope(), text_attention_mask.bool()
        cap_lens = [int(n) for n in mask.sum(dim=1)]
        ids = [sample_ids(n, [(x.shape[1] // p, x.shape[2] // p) for x in r], (h // p, w // p), cap.device)
               for n, r in zip(cap_lens, refs)]

        cap_freqs, _ = padded([rotary(tables, i[0]) for i in ids], cap.shape[1])
        for block in self.context_refiner:
            cap = block(cap, mask, cap_freqs)
        img = self.x_embedder(torch.stack([patchify(x, p) for x in hidden_states]))
        img_freqs = torch.stack([rotary(tables, i[2]) for i in ids])
        for block in self.noise_refiner:
            img = block(img, None, img_freqs, temb)
        ref_tokens = self.refine_references(refs, temb, [rotary(tables, i[1]) for i in ids])

        rows = [torch.cat([cap[k, :n], ref_tokens[k], img[k]]) for k, n in enumerate(cap_lens)]
        tokens, joint_mask = padded(rows)
        freqs, _ = padded([rotary(tables, torch.cat(i)) for i in ids])
        for block in self.layers:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                tokens = self._gradient_checkpointing_func(block, tokens, joint_mask, freqs, temb)
            else:
                tokens = block(tokens, joint_mask, freqs, temb)
        tokens = self.norm_out(tokens, temb)
        n_img = (h // p) * (w // p)
        out = torch.stack([unpatchify(tokens[k, r.shape[0] - n_img : r.shape[0]], h, w, p, self.out_channels)
                           for k, r in enumerate(rows)])
        return Transformer2DModelOutput(sample=out) if return_dict else out
