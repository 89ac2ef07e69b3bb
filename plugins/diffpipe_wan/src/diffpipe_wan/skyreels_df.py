"""Diffusion forcing of SkyReels V2: per-latent-frame noise levels in training, and the sampler of
``SkyReelsV2DiffusionForcingPipeline``.

Training (the SkyReels-V2 report, section "Diffusion Forcing"): every latent frame gets its own time, drawn with the
authors' frame-oriented probability propagation (FoPP): the times never decrease along the clip (an earlier frame is
never noisier than a later one, the order in which the pipeline denoises), a frame is picked uniformly and its level
uniformly among ``LEVELS`` levels, and every other frame's level follows from the number of non-decreasing sequences
through it (dynamic programming over levels), so each sequence of levels through the picked frame is equally likely.
Frames of one causal block share their level. A level ``l`` is the ``(l + 0.5) / LEVELS`` quantile of the run's time
distribution (``timestep_sample_method``, ``sigmoid_scale``, ``shift``), mapped onto ``[min_t, max_t]`` as every
flow run maps its times.

Sampling: the pipeline's own ``generate_timestep_matrix`` (short videos: no prefix, the whole clip in one window),
one copy of the folder's scheduler per latent frame, each frame stepped only where the matrix's update mask says.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from diffpipe_core.diffusion import sample_timesteps
from diffpipe_core.parts.flow import limit_times

LEVELS = 1000  # the pipeline's num_train_timesteps


def _counts(blocks: int, levels: int, forward: bool) -> torch.Tensor:
    """``(blocks, levels)`` relative counts of non-decreasing level sequences: ``forward``: of blocks ``i..end``
    with block ``i`` at each level; else of blocks ``0..i`` with block ``i`` at each level (each row rescaled to
    its maximum, which leaves the conditional probabilities of that row unchanged)."""
    rows = [torch.ones(levels, dtype=torch.float64)]
    for _ in range(blocks - 1):
        prev = rows[-1]
        row = prev.flip(0).cumsum(0).flip(0) if forward else prev.cumsum(0)
        rows.append(row / row.max())
    stacked = torch.stack(rows)
    return stacked.flip(0) if forward else stacked


def fopp_levels(blocks: int, generator: torch.Generator, levels: int = LEVELS) -> torch.Tensor:
    """``(blocks,)`` non-decreasing levels in ``[0, levels)`` drawn by FoPP (module docstring), from ``generator``."""
    after, before = _counts(blocks, levels, forward=True), _counts(blocks, levels, forward=False)
    picked = int(torch.randint(blocks, (1,), generator=generator))
    out = torch.zeros(blocks, dtype=torch.long)
    out[picked] = int(torch.randint(levels, (1,), generator=generator))
    for i in range(picked + 1, blocks):  # later blocks: at or above the previous one
        weights = after[i].clone()
        weights[: out[i - 1]] = 0
        out[i] = int(torch.multinomial(weights, 1, generator=generator))
    for i in range(picked - 1, -1, -1):  # earlier blocks: at or below the next one
        weights = before[i].clone()
        weights[out[i + 1] + 1 :] = 0
        out[i] = int(torch.multinomial(weights, 1, generator=generator))
    return out


def frame_times(
    batch: int, frames: int, frames_per_block: int, cfg: Any, shift: float, time_range: tuple[float, float],
    generator: torch.Generator, quantile: float | None = None,
) -> torch.Tensor:
    """``(batch, frames)`` times in (0, 1), one per latent frame (those of a causal block equal), non-decreasing along
    each clip; with ``quantile`` (evaluation) every frame at that quantile of the time distribution."""
    blocks = -(-frames // frames_per_block)
    if quantile is not None:
        q = torch.full((batch, blocks), float(quantile), dtype=torch.float64)
    else:
        q = torch.stack([(fopp_levels(blocks, generator) + 0.5) / LEVELS for _ in range(batch)])
    unique = sorted(set(q.flatten().tolist()))
    times = {u: float(sample_timesteps(1, generator, cfg.timestep_sample_method, cfg.sigmoid_scale, shift,
                                       quantile=u)[0]) for u in unique}  # fmt: skip
    t = torch.tensor([[times[u] for u in row] for row in q.tolist()], dtype=torch.float32)
    t = limit_times(t, *time_range)
    return t.repeat_interleave(frames_per_block, dim=1)[:, :frames]


def frame_flow_pair(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_t = (1 - t_f) x + t_f noise`` per latent frame (``t``: ``(B, F')``, latents ``(B, C, F', h, w)``) and the
    velocity target ``noise - x``."""
    t_b = t.view(t.shape[0], 1, t.shape[1], 1, 1).to(latents.dtype)
    return (1 - t_b) * latents + t_b * noise, noise - latents


@dataclass
class ForcingSchedule:
    """A diffusion-forcing sample's schedule: the timestep matrix ``(iterations, F')``, its update mask and one
    scheduler per latent frame (each stepped only where the mask says)."""

    matrix: torch.Tensor
    update: torch.Tensor
    schedulers: list[Any]
    num_train_timesteps: float
    latents: torch.Tensor | None = None  # the latents every frame is stepped in (forcing_step)


def forcing_schedule(scheduler: Any, steps: int, frames: int, ar_step: int, causal_block_size: int) -> torch.Tensor:
    """The schedule tensor (``iterations + 1`` entries, so the core's loop runs every iteration) carrying a
    :class:`ForcingSchedule` as ``diffpipe_forcing``; ``scheduler``: the folder's, ``frames``: latent frames."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    scheduler.set_timesteps(steps)
    matrix, _, update, _ = SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(
        None, frames, scheduler.timesteps, frames, ar_step, 0, causal_block_size
    )
    per_frame = []
    for _ in range(frames):
        one = copy.deepcopy(scheduler)
        one.set_timesteps(steps)
        per_frame.append(one)
    schedule = torch.arange(len(matrix) + 1, dtype=torch.float32)
    trained = float(scheduler.config.num_train_timesteps)
    schedule.diffpipe_forcing = ForcingSchedule(matrix, update, per_frame, trained)  # type: ignore[attr-defined]
    return schedule


def forcing_of(schedule: torch.Tensor) -> ForcingSchedule | None:
    """The :class:`ForcingSchedule` a schedule carries (None: an ordinary one)."""
    return getattr(schedule, "diffpipe_forcing", None)


def forcing_times(forcing: ForcingSchedule, index: int, batch: int) -> torch.Tensor:
    """``(batch, F')`` flow times of iteration ``index`` (the matrix's timesteps over ``num_train_timesteps``)."""
    return (forcing.matrix[index].float() / forcing.num_train_timesteps).expand(batch, -1)


def forcing_step(forcing: ForcingSchedule, latents: torch.Tensor, prediction: torch.Tensor, index: int) -> torch.Tensor:
    """Iteration ``index``: each latent frame the update mask names stepped by its own scheduler, the others kept.

    As in the pipeline, the frames are stepped in place in one latents tensor kept for the whole sample, so what a
    scheduler remembers of its last input (UniPC's ``last_sample``, a view of that tensor) is the frame's current
    latents when its corrector next runs: the same arithmetic as the pipeline's, not only the same formula."""
    if forcing.latents is None or index == 0:
        forcing.latents = latents.float().clone()
    work = forcing.latents
    work.copy_(latents)
    row = forcing.matrix[index]
    for f in range(work.shape[2]):
        if forcing.update[index][f]:
            work[:, :, f] = forcing.schedulers[f].step(prediction[:, :, f].float(), row[f], work[:, :, f],
                                                       return_dict=False)[0]  # fmt: skip
    return work
