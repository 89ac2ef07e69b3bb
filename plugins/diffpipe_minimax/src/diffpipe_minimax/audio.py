"""MiniMax H3's audio latents: stereo waveforms through its mono audio VAE, as the pipeline encodes a soundtrack."""

from __future__ import annotations

from typing import Any

import torch

from diffpipe_minimax.packing import audio_latent_count


def encode_audio(audio_vae: Any, waveform: torch.Tensor, frames: int) -> torch.Tensor:
    """``(B, 2, S)`` stereo in [-1, 1] -> ``(B, 2 L, C)`` rows, each item as ``MiniMaxH3Ref2VAReferenceEncoderStep``
    encodes a reference soundtrack (the two channels as two items of the mono VAE, the posterior's mean, normalised by
    ``latents_mean`` / ``latents_std``, channel-major rows); ``L`` the pipeline's audio latents for ``frames`` video
    frames (a VAE output one latent short is padded by repeating its last, a longer one cut)."""
    config = audio_vae.config
    channels = int(config.latent_channels)
    mean = torch.tensor(config.latents_mean).view(1, 1, -1)
    std = torch.tensor(config.latents_std).view(1, 1, -1)
    param = next(audio_vae.parameters())
    length = audio_latent_count(frames)
    rows = []
    for item in waveform:
        with torch.no_grad():
            posterior = audio_vae.encode(item[:, None].to(param.device, param.dtype), return_dict=False)[0]
        latents = posterior.mode().float().cpu().transpose(1, 2)  # (2, L', C)
        if latents.shape[1] < length:
            latents = torch.cat([latents, latents[:, -1:].expand(-1, length - latents.shape[1], -1)], dim=1)
        normalized = (latents[:, :length] - mean) / std
        rows.append(normalized.reshape(-1, channels))
    return torch.stack(rows)
