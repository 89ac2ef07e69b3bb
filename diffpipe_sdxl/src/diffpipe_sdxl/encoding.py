"""What SDXL caches: VAE latents with the micro-conditioning ``time_ids`` (from the media), and the two CLIP
text encoders' outputs (from the captions)."""

from __future__ import annotations

from typing import Any

import torch

from diffpipe_core import EncodeBatch
from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode
from diffpipe_core.parts.text import chunk_token_ids, encode_chunks


def time_ids(batch: EncodeBatch) -> torch.Tensor:
    """``(B, 6)`` float32: original (h, w), crop top-left (top, left), target (h, w) per sample.

    The target size is the size of the pixels handed to the VAE; the original size and the crop come from
    the data pipeline's decode (``EncodeBatch.original_sizes`` / ``crop_coords``). Without them (a batch
    that was not cropped), the original size is the target size and the crop is (0, 0).
    """
    assert batch.pixels is not None
    n, h, w = batch.pixels.shape[0], batch.pixels.shape[-2], batch.pixels.shape[-1]
    originals = batch.original_sizes or [(h, w)] * n
    crops = batch.crop_coords or [(0, 0)] * n
    rows = [[*map(float, o), *map(float, c), float(h), float(w)] for o, c in zip(originals, crops)]
    return torch.tensor(rows, dtype=torch.float32)


def conditioning(encoders: tuple[Any, Any], ids: tuple[torch.Tensor, ...], masks: tuple[torch.Tensor, ...]):
    """``(text_embeds (B, 77*k, d1 + d2), text_mask (B, 77*k), pooled (B, d))``: the penultimate hidden states of both
    encoders side by side per token, the chunks valid for both, and text_encoder_2's projected pooled output of the
    first chunk. With autograd: the first pipeline layer runs it when the encoders train."""
    one, two = (encode_chunks(e, i, m, -2, p) for e, i, m, p in zip(encoders, ids, masks, (None, "text_embeds")))
    return torch.cat([one.embeds, two.embeds], dim=-1), one.mask & two.mask, two.pooled


def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Media: ``latents`` (the posterior mean times the VAE's scaling factor), ``time_ids`` and ``mask`` (at latent
    resolution). Captions: ``text_embeds``, ``text_mask``, ``pooled`` (:func:`conditioning`); with the text encoders
    trained, their token ids instead: ``ids``, ``ids_2`` ``(B, k, 77)`` and ``chunks``, ``chunks_2`` ``(B, k)``."""
    out: dict[str, torch.Tensor] = {}
    if batch.pixels is not None:
        if batch.pixels.dim() != 4:
            raise ValueError(f"SDXL encodes images (B, C, H, W); got pixels of shape {tuple(batch.pixels.shape)}")
        out["latents"] = shift_and_scale(vae_mode(encoders.vae, batch.pixels), encoders.vae.config)
        out["time_ids"] = time_ids(batch)
        if batch.masks is not None:
            out["mask"] = latent_mask(batch.masks, out["latents"].shape)
    if batch.captions is not None:
        k = encoders.config.max_prompt_chunks
        tokens = [chunk_token_ids(t, list(batch.captions), k) for t in (encoders.tokenizer, encoders.tokenizer_2)]
        if encoders.config.train_text_encoders:
            return {"ids": tokens[0][0], "chunks": tokens[0][1], "ids_2": tokens[1][0], "chunks_2": tokens[1][1]}
        with torch.no_grad():
            embeds, mask, pooled = conditioning(
                (encoders.text_encoder, encoders.text_encoder_2), *zip(*tokens)
            )
        out.update(text_embeds=embeds.cpu(), text_mask=mask.cpu(), pooled=pooled.cpu())
    return out
