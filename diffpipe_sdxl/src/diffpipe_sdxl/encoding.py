"""What SDXL caches: VAE latents with the micro-conditioning ``time_ids`` (from the media), and the two CLIP
text encoders' outputs (from the captions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffpipe_core import EncodeBatch
from diffpipe_sdxl.loading import Encoders

CHUNK = 77  # CLIP's context: BOS + 75 tokens + EOS
BODY = CHUNK - 2


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


def encode_media(encoders: Encoders, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """``latents`` (the posterior mean, times the VAE's scaling factor), ``time_ids``, and ``mask`` (the loss mask
    at latent resolution) when the batch has masks."""
    vae = encoders.vae
    assert batch.pixels is not None
    if batch.pixels.dim() != 4:
        raise ValueError(f"SDXL encodes images (B, C, H, W); got pixels of shape {tuple(batch.pixels.shape)}")
    param = next(vae.parameters())
    with torch.no_grad():
        posterior = vae.encode(batch.pixels.to(param.device, param.dtype)).latent_dist
        latents = posterior.mean.float() * vae.config.scaling_factor
    out = {"latents": latents, "time_ids": time_ids(batch)}
    if batch.masks is not None:
        out["mask"] = F.adaptive_avg_pool2d(batch.masks.float(), latents.shape[-2:])
    return out


def chunk_token_ids(tokenizer: object, captions: list[str], max_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(B, max_chunks, 77)`` and a chunk mask ``(B, max_chunks)`` (bool).

    Each caption's tokens are cut into chunks of 75, each wrapped as ``BOS tokens EOS pad...`` (A1111/kohya
    style), at most ``max_chunks`` (longer prompts are truncated). A caption that fits in 75 tokens gives
    exactly diffusers' ``padding="max_length", max_length=77`` ids in its first chunk. Unused chunks hold
    ``BOS EOS pad...`` and are masked out.
    """
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id  # type: ignore[attr-defined]
    tokens = tokenizer(captions, add_special_tokens=False, truncation=False)["input_ids"]  # type: ignore[operator]
    ids = torch.full((len(captions), max_chunks, CHUNK), pad, dtype=torch.long)
    ids[:, :, 0] = bos
    mask = torch.zeros(len(captions), max_chunks, dtype=torch.bool)
    for b, seq in enumerate(tokens):
        seq = list(seq)[: BODY * max_chunks]
        n_chunks = max(1, -(-len(seq) // BODY))
        for c in range(max_chunks):
            body = seq[c * BODY : (c + 1) * BODY] if c < n_chunks else []
            ids[b, c, 1 : 1 + len(body)] = torch.tensor(body, dtype=torch.long)
            ids[b, c, 1 + len(body)] = eos
        mask[b, :n_chunks] = True
    return ids, mask


def encode_text(encoders: Encoders, captions: list[str]) -> dict[str, torch.Tensor]:
    """``text_embeds`` ``(B, 77*k, 768+1280)``: the penultimate hidden states of both encoders concatenated per
    token; ``text_mask`` ``(B, 77*k)`` (bool, whole chunks); ``pooled`` ``(B, 1280)``: text_encoder_2's projected
    pooled output of the first chunk."""
    k = encoders.max_prompt_chunks
    n = len(captions)
    hidden, pooled, mask = [], None, None
    for tokenizer, encoder in zip(encoders.tokenizers, encoders.text_encoders):
        ids, chunk_mask = chunk_token_ids(tokenizer, captions, k)
        mask = chunk_mask if mask is None else mask & chunk_mask
        device = next(encoder.parameters()).device
        valid = chunk_mask.reshape(-1)
        flat_ids = ids.reshape(-1, CHUNK)[valid].to(device)
        with torch.no_grad():
            out = encoder(flat_ids, output_hidden_states=True)
        states = out.hidden_states[-2].float()
        full = torch.zeros(n * k, CHUNK, states.shape[-1], dtype=torch.float32, device=states.device)
        full[valid.to(states.device)] = states
        hidden.append(full.reshape(n, k * CHUNK, -1))
        if hasattr(out, "text_embeds"):  # text_encoder_2: the pooled output of each caption's first chunk
            counts = chunk_mask.sum(1)  # chunk 0 is always valid: caption b's is row `valid chunks before b`
            pooled = out.text_embeds.float()[(counts.cumsum(0) - counts).to(states.device)]
    assert pooled is not None and mask is not None
    token_mask = mask.repeat_interleave(CHUNK, dim=1)
    return {"text_embeds": torch.cat(hidden, dim=-1).cpu(), "text_mask": token_mask, "pooled": pooled.cpu()}


def encode_batch(encoders: Encoders, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Media batch -> latents, time_ids (and mask); caption batch -> text_embeds, text_mask, pooled."""
    out: dict[str, torch.Tensor] = {}
    if batch.pixels is not None:
        out.update(encode_media(encoders, batch))
    if batch.captions is not None:
        out.update(encode_text(encoders, list(batch.captions)))
    return out
