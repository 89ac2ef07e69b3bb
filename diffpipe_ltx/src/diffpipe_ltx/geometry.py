"""What LTX-Video's pipeline derives from its folder's configs: the VAE's compression, the rotary embedding's
interpolation scale, and the scheduler's sequence-length shift constants."""

from __future__ import annotations

import json
from typing import Any

from diffpipe_ltx.config import LTXConfig

FRAME_RATE = 25  # LTXPipeline's default frame_rate; videos are resampled to it (ModelSpec.video_fps)


def vae_compression(vae: dict[str, Any]) -> tuple[int, int]:
    """``(temporal, spatial)`` compression of the VAE config ``vae``, computed as ``AutoencoderKLLTXVideo`` does."""
    levels = sum(bool(s) for s in vae.get("spatio_temporal_scaling", (True, True, True, False)))
    spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 2**levels
    temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2**levels
    return int(temporal), int(spatial)


def rope_interpolation_scale(cfg: LTXConfig) -> tuple[float, float, float]:
    """LTXPipeline's ``(vae_temporal / frame_rate, vae_spatial, vae_spatial)``."""
    from diffpipe_ltx.plugin import plugin

    temporal, spatial = vae_compression(plugin.folder.config(cfg.path, "vae"))
    return (temporal / FRAME_RATE, float(spatial), float(spatial))


def shift_constants(cfg: LTXConfig) -> tuple[int, int, float, float]:
    """``(base_seq_len, max_seq_len, base_shift, max_shift)`` from the scheduler config, with LTXPipeline's
    defaults for any that are missing."""
    file = cfg.path / "scheduler" / "scheduler_config.json"
    sched = json.loads(file.read_text()) if file.is_file() else {}
    return (
        int(sched.get("base_image_seq_len", 256)),
        int(sched.get("max_image_seq_len", 4096)),
        float(sched.get("base_shift", 0.5)),
        float(sched.get("max_shift", 1.15)),
    )
