"""Flux's side of sampling: noise and the resolution-shifted flow-matching schedule as ``FluxPipeline`` makes
them, first-layer inputs on packed latents, the Euler step, and VAE decoding. The loop, guidance, prompts and
writing are diffpipe-core's (:mod:`diffpipe_core.sampling`)."""

from __future__ import annotations

import json
from typing import Any

import torch

from diffpipe_core.diffusion import flux_resolution_shift
from diffpipe_core.sampling.schedules import flow_euler_step, flow_sigmas
from diffpipe_core.types import SampleRequest
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.encoding import DTYPES
from diffpipe_flux.packing import image_ids, pack, text_ids, unpack

DEFAULT_GUIDANCE = 3.5  # FluxPipeline's guidance_scale default
# FluxPipeline's scheduler settings, used when the folder has no scheduler/scheduler_config.json
DEFAULT_SCHEDULER = {
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "shift": 1.0,
}


def _read_json(cfg: FluxConfig, relative: str) -> dict[str, Any] | None:
    file = cfg.path / relative
    return json.loads(file.read_text()) if file.is_file() else None


def vae_config(cfg: FluxConfig) -> dict[str, Any]:
    config = _read_json(cfg, "vae/config.json")
    if config is None:
        raise FileNotFoundError(f"{cfg.path / 'vae' / 'config.json'}: not found; sampling decodes with the Flux VAE")
    return config


def latent_size(cfg: FluxConfig, request: SampleRequest) -> tuple[int, int, int]:
    """``(channels, h, w)`` of the unpacked latents, as ``FluxPipeline.prepare_latents`` sizes them."""
    vae = vae_config(cfg)
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    return int(vae["latent_channels"]), 2 * (request.height // (factor * 2)), 2 * (request.width // (factor * 2))


def schedule_shift(cfg: FluxConfig, image_tokens: int) -> float:
    """The scheduler's shift: e^mu with mu linear in the image token count (dev), or its fixed ``shift``."""
    sched = {**DEFAULT_SCHEDULER, **(_read_json(cfg, "scheduler/scheduler_config.json") or {})}
    if sched["use_dynamic_shifting"]:
        return flux_resolution_shift(
            image_tokens,
            sched["base_image_seq_len"],
            sched["max_image_seq_len"],
            sched["base_shift"],
            sched["max_shift"],
        )
    return float(sched["shift"])


def denoise_init(request: SampleRequest, cfg: FluxConfig, generator: torch.Generator):
    """Noise ``(1, C, H/8, W/8)`` and ``FluxPipeline``'s sigmas (``linspace(1, 1/steps)`` shifted, then 0)."""
    c, h, w = latent_size(cfg, request)
    latents = torch.randn((1, c, h, w), generator=generator)
    return latents, flow_sigmas(request.steps, schedule_shift(cfg, (h // 2) * (w // 2)))


def denoise_inputs(
    latents: torch.Tensor,
    schedule: torch.Tensor,
    index: int,
    text: dict[str, torch.Tensor],
    request: SampleRequest,
) -> tuple[torch.Tensor, ...]:
    """The first layer's ``(packed x, t, t5_embeds, clip_pooled, guidance, img_ids, txt_ids)``."""
    b, _, h, w = latents.shape
    guidance = DEFAULT_GUIDANCE if request.guidance is None else request.guidance
    t5 = text["t5_embeds"].float()
    return (
        pack(latents.float()),
        schedule[index].float().expand(b),
        t5,
        text["clip_pooled"].float(),
        torch.full((b,), float(guidance)),
        image_ids(h, w),
        text_ids(t5.shape[1]),
    )


def denoise_step(latents: torch.Tensor, prediction: torch.Tensor, schedule: torch.Tensor, index: int) -> torch.Tensor:
    """Euler on the flow ODE, with the packed velocity unpacked to the latents' layout."""
    velocity = unpack(prediction, latents.shape[-2], latents.shape[-1])
    return flow_euler_step(latents, velocity, schedule, index)


def load_decoder(cfg: FluxConfig, device: torch.device):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(
        str(cfg.path / "vae"), torch_dtype=DTYPES[cfg.encoder_dtype], local_files_only=True
    )
    return vae.to(device).eval().requires_grad_(False)


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Undo the cache's ``(x - shift) * scale`` and decode, as ``FluxPipeline`` does; [-1, 1] float32."""
    shift = vae.config.shift_factor or 0.0
    latents = latents.float() / vae.config.scaling_factor + shift
    param = next(vae.parameters())
    return vae.decode(latents.to(param.device, param.dtype)).sample.float().clamp(-1, 1)
