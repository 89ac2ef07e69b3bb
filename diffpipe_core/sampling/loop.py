"""The denoising loop: the plugin's step hooks around a forward function, with classifier-free guidance.

The loop is the same whether the forward is the training ``PipelineEngine`` (:mod:`.pipeline`) or a plain
chain of the plugin's layers, so a sample made during training can be checked against the model run
directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from diffpipe_core.registry import ModelPlugin
from diffpipe_core.types import ModelConfigBase, SampleRequest

Tensors = tuple[torch.Tensor, ...]
Forward = Callable[[list[Tensors]], list[torch.Tensor]]
"""Runs a list of first-layer input tuples (one micro-batch each) and returns each one's prediction: the
first tensor the last layer returns."""


@dataclass
class PromptText:
    """One prompt's text-encoder outputs (batch dimension 1), and those of the negative prompt for CFG."""

    cond: dict[str, torch.Tensor]
    uncond: dict[str, torch.Tensor] | None = None


def noise_generator(seed: int, index: int) -> torch.Generator:
    """Prompt ``index``'s noise generator: the same at every sampling point and in ``diffpipe sample``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def generate(
    plugin: ModelPlugin,
    model_config: ModelConfigBase,
    request: SampleRequest,
    texts: Sequence[PromptText],
    generators: Sequence[torch.Generator],
    forward: Forward,
    cfg: float = 1.0,
    unconditional: Forward | None = None,
) -> list[torch.Tensor]:
    """Denoise one sample per entry of ``texts`` and return their final latents (float32, on the CPU).

    Each step sends every sample as its own micro-batch through ``forward``; with ``cfg > 1`` a micro-batch
    holds the negative and the positive prompt (batch 2; two micro-batches of 1 for a model whose spec says
    ``guidance_in_one_batch = False``) and the two predictions are combined by :func:`combine_guidance` before the
    plugin's ``denoise_step``. For a model whose spec declares ``unconditional_model`` the negative branch is instead
    its ``unconditional_inputs`` through ``unconditional`` (the frozen second model's forward; required then), and
    ``forward`` runs the positive prompt alone.
    """
    if len(texts) != len(generators):
        raise ValueError(f"{len(texts)} prompts but {len(generators)} noise generators")
    guided = cfg > 1.0
    separate = guided and plugin.spec.unconditional_model is not None
    if separate and unconditional is None:
        raise ValueError(f"cfg > 1 runs {plugin.name!r}'s {plugin.spec.unconditional_model}: no forward given for it")
    states = []
    for text, gen in zip(texts, generators, strict=True):
        latents, schedule = plugin.require("denoise_init", request=request, model_config=model_config, generator=gen)
        if guided and not separate and text.uncond is None:
            raise ValueError("cfg > 1 needs the negative prompt's text encoding")
        if not guided or separate:
            batches = [text.cond]
        elif plugin.spec.guidance_in_one_batch:
            batches = [_cat(text.uncond, text.cond)]
        else:
            batches = [text.uncond, text.cond]
        states.append([latents, schedule, batches])
    steps = len(states[0][1]) - 1 if states else 0
    for index in range(steps):
        inputs = []
        for latents, schedule, batches in states:
            step = {"schedule": schedule, "index": index, "request": request, "model_config": model_config}
            for batch_text in batches:
                n = next(iter(batch_text.values())).shape[0]
                model_latents = torch.cat([latents] * n) if n > 1 else latents
                inputs.append(plugin.require("denoise_inputs", latents=model_latents, text=batch_text, **step))
        outputs = iter(forward(inputs))
        predictions = [torch.cat([next(outputs) for _ in batches]) for _, _, batches in states]
        if separate:
            assert unconditional is not None
            negatives = unconditional([
                plugin.require("unconditional_inputs", latents=latents, schedule=schedule, index=index,
                               request=request, model_config=model_config)
                for latents, schedule, _ in states
            ])
            predictions = [torch.cat([n.float(), p.float()]) for n, p in zip(negatives, predictions, strict=True)]
        for state, prediction in zip(states, predictions, strict=True):
            if guided:
                uncond, cond = prediction.float().chunk(2)
                prediction = combine_guidance(plugin, model_config, uncond, cond, cfg, state[1], index)
            state[0] = plugin.require(
                "denoise_step",
                latents=state[0],
                prediction=prediction,
                schedule=state[1],
                index=index,
                model_config=model_config,
            )
    return [state[0].float().cpu() for state in states]


def combine_guidance(
    plugin: ModelPlugin,
    model_config: ModelConfigBase,
    uncond: torch.Tensor,
    cond: torch.Tensor,
    scale: float,
    schedule: torch.Tensor,
    index: int,
) -> torch.Tensor:
    """The guided prediction: the plugin's ``combine_guidance`` hook when it implements one (a pipeline that
    rescales true CFG, e.g. Qwen-Image), else ``uncond + scale * (cond - uncond)``."""
    if plugin.has("combine_guidance"):
        step = {"schedule": schedule, "index": index, "model_config": model_config}
        return plugin.require("combine_guidance", uncond=uncond, cond=cond, scale=scale, **step).float()
    return uncond + scale * (cond - uncond)


def _cat(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    assert a is not None
    return {key: torch.cat([a[key], b[key]]) for key in b}
