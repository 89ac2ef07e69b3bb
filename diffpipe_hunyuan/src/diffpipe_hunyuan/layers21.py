"""HunyuanImage-2.1 cut into pipeline layers: embedders (+ the joint text sequence), each double-stream block, each
single-stream block, the final norm/projection (HunyuanVideo 1.0's block layers: the blocks take the same arguments).

- into the first layer: ``(x_t (B, C, H, W), t, text_embeds, text_mask, glyph_embeds, glyph_mask, guidance, t_r)``:
  ``t`` and ``t_r`` in [0, 1] (the pipeline's scheduler timesteps / 1000), ``guidance`` the distilled guidance scale;
  ``guidance`` is read only by a guidance-distilled transformer, ``t_r`` only by a MeanFlow one.
- between blocks: ``(img_tokens, txt_tokens, temb, rope_cos, rope_sin, attention_mask, grid)`` as
  :mod:`diffpipe_hunyuan.layers` carries them; ``attention_mask`` ``(B, 1, 1, N_img + N_txt)`` bool, ``grid`` the
  latent ``(h, w)`` after patching.
- the last single block hands on ``(img_tokens, temb, grid)``; the final layer returns ``(prediction (B, C, H, W),)``
  in float32.

The text sequence is the glyph and Qwen tokens with each sample's valid ones first (valid glyph, valid Qwen, padding),
as ``HunyuanImageTransformer2DModel.forward`` orders them; the layers call the model's own submodules as that forward
does, so a pipeline of them computes the same function as the diffusers model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffpipe_hunyuan.layers import stacked

Tensors = tuple[torch.Tensor, ...]


def joint_text(
    text: torch.Tensor, text_mask: torch.Tensor, glyph: torch.Tensor | None, glyph_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The text tokens and their bool mask: without glyph tokens the Qwen tokens as they are; with them
    ``[valid glyph, valid Qwen, padded glyph, padded Qwen]`` per sample (a stable sort on the validity)."""
    text_mask = text_mask.bool()
    if glyph is None:
        return text, text_mask
    tokens, mask = torch.cat([glyph, text], dim=1), torch.cat([glyph_mask.bool(), text_mask], dim=1)
    kind = torch.cat([torch.zeros_like(glyph_mask, dtype=torch.uint8), torch.ones_like(text_mask, dtype=torch.uint8)],
                     dim=1)
    order = torch.argsort((~mask).to(torch.uint8) * 2 + kind, dim=1, stable=True)
    return tokens.gather(1, order[..., None].expand_as(tokens)), mask.gather(1, order)


class EmbedLayer(nn.Module):
    """Patch, time (+ guidance, + MeanFlow's second time) and text embeddings (the Qwen token refiner, the glyph
    projection), the 2-D rotary embedding and the joint attention mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.context_embedder_2, self.time_guidance_embed, self.rope = (
            model.context_embedder_2, model.time_guidance_embed, model.rope
        )
        self.guidance = bool(model.config.guidance_embeds)
        self.meanflow = bool(model.config.use_meanflow)
        self.patch = tuple(int(p) for p in model.config.patch_size)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask, glyph, glyph_mask, guidance, t_r = inputs
        dtype = self.x_embedder.proj.bias.dtype  # the compute dtype (a quantized file's weights are stored otherwise)
        timestep = (t * 1000).to(dtype)  # the pipeline's scheduler timesteps are in [0, 1000]
        temb = self.time_guidance_embed(
            timestep,
            timestep_r=(t_r * 1000).to(dtype) if self.meanflow else None,
            guidance=(guidance * 1000).to(dtype) if self.guidance else None,
        )
        cos, sin = self.rope(x)
        img = self.x_embedder(x.to(dtype)).contiguous()  # a transposed view; stage boundaries send contiguous
        text_mask = text_mask.bool()
        txt = self.context_embedder(text.to(dtype), timestep, text_mask)
        if self.context_embedder_2 is not None:
            txt, mask = joint_text(txt, text_mask, self.context_embedder_2(glyph.to(dtype)), glyph_mask)
        else:
            txt, mask = joint_text(txt, text_mask, None, None)
        attention_mask = F.pad(mask, (img.shape[1], 0), value=True)[:, None, None]
        grid = torch.tensor([x.shape[2] // self.patch[0], x.shape[3] // self.patch[1]], device=img.device)
        return img, txt.contiguous(), temb, cos, sin, attention_mask, grid


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``HunyuanImageTransformer2DModel`` (sharing its parameters)."""
    if len(model.config.patch_size) != 2:
        raise ValueError(
            f"patch_size={list(model.config.patch_size)}: a 3-D HunyuanImage transformer (the refiner) is not "
            "supported by diffpipe's hunyuan-image-2.1; give the HunyuanImage-2.1 (or its distilled) transformer"
        )
    return stacked(model, EmbedLayer(model), "HunyuanImage-2.1")
