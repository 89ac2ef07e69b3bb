"""FLUX.2's latents as ``Flux2Pipeline`` / ``Flux2KleinPipeline`` make them: the VAE posterior's mode cut into 2x2
patches (``(B, 4C, H/16, W/16)``, channel ``4c + 2dy + dx``), normalised by the VAE's batch-norm running statistics
(``vae.bn``), one token per patch; position ids with four axes (time, row, column, sequence); reference images
(edit) appended after the target's tokens at their own times; and the start of sampling (noise on the patch grid,
the pipelines' empirical ``mu`` as the time shift).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diffpipe_core.parts.flux2_vae import bn_stats
from diffpipe_core.parts.latents import denormalize, normalize
from diffpipe_core.sampling.schedules import flow_sigmas
from diffpipe_flux.packing import grid_ids, pack, unpack


def patchify(z: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, 4C, H/2, W/2)`` (``Flux2Pipeline._patchify_latents``)."""
    b, c, h, w = z.shape
    return pack(z).transpose(1, 2).reshape(b, 4 * c, h // 2, w // 2)


def unpatchify(z: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify` (``Flux2Pipeline._unpatchify_latents``)."""
    _, _, h, w = z.shape
    return unpack(z.flatten(2).transpose(1, 2), 2 * h, 2 * w)


def tokens(z: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, h*w, C)`` row by row (``Flux2Pipeline._pack_latents``)."""
    return z.flatten(2).transpose(1, 2)


def untokens(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`tokens` for a ``h x w`` grid."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)


def normalized(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """Posterior latents ``(B, C, H, W)`` as the transformer sees them: patchified and batch-norm normalised."""
    return normalize(patchify(z.float().cpu()), *bn_stats(vae))


def raw(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`normalized`: the latents the VAE decodes."""
    return unpatchify(denormalize(z.float().cpu(), *bn_stats(vae)))


def image_ids(h: int, w: int) -> torch.Tensor:
    """``(h*w, 4)`` ids ``[0, row, col, 0]`` of the patch grid (``_prepare_latent_ids``)."""
    return grid_ids(h, w, axes=4)


#: the time-axis spacing of reference images: the k-th (from 0) has time ``10 + 10 k`` (``_prepare_image_ids``)
REFERENCE_TIME_SCALE = 10


def with_references(
    x: torch.Tensor, ids: torch.Tensor, references: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's tokens ``x`` ``(B, n, C)`` and ids ``(n, 4)`` followed by each reference image's (latents
    ``(B or 1, C, h_k, w_k)``, normalised as a target's), as ``prepare_image_latents`` and the denoising loop join them:
    reference ``k``'s tokens row by row with ids ``[10 + 10 k, row, col, 0]``."""
    parts, all_ids = [x], [ids]
    for k, ref in enumerate(references):
        parts.append(tokens(ref.float()).expand(x.shape[0], -1, -1))
        ref_ids = image_ids(*ref.shape[-2:])
        ref_ids[:, 0] = REFERENCE_TIME_SCALE * (k + 1)
        all_ids.append(ref_ids)
    return torch.cat(parts, dim=1), torch.cat(all_ids)


def text_ids(n: int) -> torch.Tensor:
    """``(n, 4)`` ids ``[0, 0, 0, i]`` of the text tokens (``_prepare_text_ids``)."""
    ids = torch.zeros(n, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(n)
    return ids


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The pipelines' ``compute_empirical_mu``: the time shift's exponent, from BFL's fit over token count and
    step count."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + m_200 - 200.0 * a)


def denoise_init(transformer: dict[str, Any], vae: dict[str, Any], scheduler: dict[str, Any], request: Any, generator):
    """Noise ``(1, in_channels, H/16, W/16)`` as the pipelines' ``prepare_latents`` draws it, and their sigmas:
    ``linspace(1, 1/steps)`` shifted by ``e^mu`` (the scheduler's ``shift`` without dynamic shifting), then 0."""
    factor = 2 ** (len(vae["block_out_channels"]) - 1) * 2
    h, w = request.height // factor, request.width // factor
    latents = torch.randn((1, int(transformer.get("in_channels", 128)), h, w), generator=generator)
    if scheduler.get("use_dynamic_shifting", True):
        shift = math.exp(empirical_mu(h * w, request.steps))
    else:
        shift = float(scheduler.get("shift", 1.0))
    return latents, flow_sigmas(request.steps, shift)
