"""Flux's start of sampling: noise and the resolution-shifted flow-matching schedule as ``FluxPipeline`` makes them.
The loop, guidance, prompts and writing are diffpipe-core's (:mod:`diffpipe_core.sampling`); the step and the
decoding are the core's shared flow-matching hooks (:class:`diffpipe_core.parts.sampling.FlowSampling`)."""

from __future__ import annotations

from typing import Any

import torch

from diffpipe_core.diffusion import flux_resolution_shift
from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_core.sampling.schedules import flow_sigmas
from diffpipe_core.types import SampleRequest
from diffpipe_flux.config import FluxConfig

# FluxPipeline's scheduler settings, used when the folder has no scheduler/scheduler_config.json
DEFAULT_SCHEDULER = {
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "shift": 1.0,
}


def latent_size(folder: DiffusersFolder, cfg: FluxConfig, request: SampleRequest) -> tuple[int, int, int]:
    """``(channels, h, w)`` of the unpacked latents, as ``FluxPipeline.prepare_latents`` sizes them."""
    vae = folder.config(cfg.path, "vae")
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    return int(vae["latent_channels"]), 2 * (request.height // (factor * 2)), 2 * (request.width // (factor * 2))


def schedule_shift(cfg: FluxConfig, image_tokens: int) -> float:
    """The scheduler's shift: e^mu with mu linear in the image token count (dev), or its fixed ``shift``."""
    file = cfg.path / "scheduler" / "scheduler_config.json"
    sched: dict[str, Any] = {**DEFAULT_SCHEDULER, **(_json(file) if file.is_file() else {})}
    if sched["use_dynamic_shifting"]:
        return flux_resolution_shift(
            image_tokens,
            sched["base_image_seq_len"],
            sched["max_image_seq_len"],
            sched["base_shift"],
            sched["max_shift"],
        )
    return float(sched["shift"])


def _json(file) -> dict[str, Any]:
    import json

    return json.loads(file.read_text())


def denoise_init(folder: DiffusersFolder, request: SampleRequest, cfg: FluxConfig, generator: torch.Generator):
    """Noise ``(1, C, H/8, W/8)`` and ``FluxPipeline``'s sigmas (``linspace(1, 1/steps)`` shifted, then 0)."""
    c, h, w = latent_size(folder, cfg, request)
    latents = torch.randn((1, c, h, w), generator=generator)
    return latents, flow_sigmas(request.steps, schedule_shift(cfg, (h // 2) * (w // 2)))
