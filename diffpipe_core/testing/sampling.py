"""Comparing diffpipe's samples with a diffusers pipeline's, in plugins' tests."""

from __future__ import annotations

from typing import Any

import torch

from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.types import SampleRequest

CPU = torch.device("cpu")


def registered(plugin: Any, name: str | None = None) -> Any:
    """The model plugin object ``plugin`` registered alone, under ``name`` (default: its spec's name), as the
    registry's model handle (``require``, ``has``) the core's sampling code takes."""
    from diffpipe_core.registry import Registry

    registry = Registry()
    name = name or plugin.model_spec().name
    info = registry.register_model(name, plugin)
    assert info.ok, info.error
    return registry.model(name)


def sample_latents(
    plugin: Any,
    model_config: Any,
    request: SampleRequest,
    texts: Any,
    seed: int,
    cfg_scale: float = 1.0,
    device: torch.device = CPU,
) -> torch.Tensor:
    """diffpipe's sample of one prompt (``texts``, from ``encode_prompts``): the core's loop over the registered
    ``plugin``'s layers (the whole model on ``device`` in float32) from the noise of ``noise_generator(seed, 0)``,
    with ``cfg_scale > 1`` through the unconditional model the plugin declares, as training's samples run it
    (:func:`~diffpipe_core.sampling.unconditional.unconditional_forward`); the final latents (on the CPU)."""
    from diffpipe_core.sampling.unconditional import unconditional_forward

    model = plugin.require("load_diffusion_model", model_config=model_config, device=device, dtype=torch.float32)
    layers = plugin.require("split_into_layers", model=model, model_config=model_config)
    forward = LayerChainForward(layers, device)
    with unconditional_forward(plugin, model_config, cfg_scale, device) as unconditional:
        (latents,) = generate(plugin, model_config, request, [texts], [noise_generator(seed, 0)], forward,
                              cfg=cfg_scale, unconditional=unconditional)
    return latents


def float32_config(schema: Any, path: Any, **keys: Any) -> Any:
    """``schema``'s ``[model]`` table of the folder ``path`` in float32 (weights and encoders) with ``keys``."""
    from diffpipe_core.schema import validate

    table = {"type": "x", "path": path, "dtype": "float32", "encoder_dtype": "float32", **keys}
    return validate(schema, table, "test")


def prompt_sample(plugin: Any, model_config: Any, prompt: str, negative: str | None, request: SampleRequest,
                  seed: int, cfg_scale: float = 1.0) -> torch.Tensor:
    """:func:`sample_latents` of ``prompt`` encoded by the plugin (``encode_prompts``; the ``negative`` prompt only
    with ``cfg_scale > 1``) for the registered model handle ``plugin``."""
    from diffpipe_core.sampling.prompts import encode_prompts

    (texts,) = encode_prompts(plugin, model_config, [prompt], negative if cfg_scale > 1 else None, CPU)
    return sample_latents(plugin, model_config, request, texts, seed, cfg_scale)


def assert_same_sample(ours: torch.Tensor, expected: torch.Tensor, noise: torch.Tensor) -> None:
    """``ours`` equals the pipeline's ``expected`` latents, and it is far from the ``noise`` both started from (so
    a loop that denoised nothing cannot pass)."""
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert (ours - noise).abs().max() > 0.1, "the sample is still its starting noise"


#: the kit's comparison with a plugin's ``sample_pipeline``: denoising steps and classifier-free guidance scale
PIPELINE_STEPS, PIPELINE_CFG = 3, 2.0


def pipeline_sample(
    pipeline_class: str,
    model_path: Any,
    prompts: tuple[str, str],
    noise: torch.Tensor,
    request: SampleRequest,
    settings: dict[str, Any],
    setup: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The final latents (``output_type="latent"``) and the sigmas of the diffusers pipeline ``pipeline_class`` loaded
    in float32 from ``model_path``, denoising ``noise`` for the prompt and negative prompt ``prompts`` in
    :data:`PIPELINE_STEPS` steps at ``guidance_scale`` :data:`PIPELINE_CFG`, with the call arguments ``settings``
    (resolution binning off, so the request's size is the sample's; ``setup(pipe, request)``, when given, sets what
    else the pipeline needs for that: the plugin's ``sample_pipeline_setup``)."""
    import inspect

    import diffusers

    cls = getattr(diffusers, pipeline_class, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise AssertionError(
            f"sample_pipeline {pipeline_class!r} is not a diffusers pipeline class (diffusers {diffusers.__version__})"
        )
    try:
        pipe = cls.from_pretrained(str(model_path), dtype=torch.float32, local_files_only=True)
    except Exception as exc:
        raise AssertionError(
            f"sample_pipeline {pipeline_class!r} does not load the tiny model folder {model_path}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    pipe.set_progress_bar_config(disable=True)
    if setup is not None:
        setup(pipe, request)
    takes = inspect.signature(pipe.__call__).parameters
    call: dict[str, Any] = {
        "prompt": prompts[0],
        "negative_prompt": prompts[1],
        "latents": noise.clone(),
        "num_inference_steps": PIPELINE_STEPS,
        "guidance_scale": PIPELINE_CFG,
        "height": request.height,
        "width": request.width,
        "output_type": "latent",
        "return_dict": False,
    }
    if "use_resolution_binning" in takes:
        call["use_resolution_binning"] = False
    if "num_frames" in takes:
        call["num_frames"] = request.frames
    try:
        with torch.no_grad():
            latents = pipe(**call, **settings)[0]
    except Exception as exc:
        raise AssertionError(
            f"sample_pipeline {pipeline_class!r} failed on the tiny model with {sorted({**call, **settings})}: "
            f"{type(exc).__name__}: {exc} (call arguments that follow [model] keys go in sample_pipeline_settings)"
        ) from exc
    return latents.float().cpu(), torch.as_tensor(pipe.scheduler.sigmas).float()
