"""HunyuanImage-2.1's guidance: diffusers' ``AdaptiveProjectedMixGuidance`` (the base checkpoint's ``guider/``) as a
function of one step, for the core's sampling loop (``combine_guidance``).

Up to ``adaptive_projected_guidance_start_step`` it is classifier-free guidance at ``guidance_scale`` (here the
sample's ``cfg``) while a momentum buffer follows ``cond - uncond``; after it, adaptive projected guidance: the
buffer's average, limited in norm to ``adaptive_projected_guidance_rescale``, split into its parts parallel and
orthogonal to ``cond``, the orthogonal part plus ``eta`` times the parallel one added to ``uncond`` at
``adaptive_projected_guidance_scale``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def apg_mix(
    uncond: torch.Tensor, cond: torch.Tensor, scale: float, index: int, config: Mapping[str, Any],
    average: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The guided prediction of step ``index`` and the momentum buffer's new average (None: no momentum) from
    ``average``, the buffer after the previous step (None at the first), for the guider ``config``."""
    momentum = config.get("adaptive_projected_guidance_momentum", -0.5)
    diff = cond - uncond
    if momentum is not None:
        average = diff if average is None else diff + momentum * average
    apg_scale = float(config.get("adaptive_projected_guidance_scale", 10.0))
    original = bool(config.get("use_original_formulation", False))
    start = int(config.get("adaptive_projected_guidance_start_step", 5))
    apg = index > start and apg_scale != (0.0 if original else 1.0)
    base = cond if original else uncond
    if not apg:
        return base + scale * diff, average
    update = average if momentum is not None else diff
    dims = list(range(1, update.ndim))
    threshold = float(config.get("adaptive_projected_guidance_rescale", 10.0))
    if threshold > 0:
        norm = update.norm(p=2, dim=dims, keepdim=True)
        update = update * torch.minimum(torch.ones_like(norm), threshold / norm)
    v0, v1 = update.double(), torch.nn.functional.normalize(cond.double(), dim=dims)
    parallel = (v0 * v1).sum(dim=dims, keepdim=True) * v1
    orthogonal = (v0 - parallel).to(update.dtype)
    return base + apg_scale * (orthogonal + float(config.get("eta", 0.0)) * parallel.to(update.dtype)), average
