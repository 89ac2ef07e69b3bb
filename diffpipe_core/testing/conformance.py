"""The plugin conformance kit: contract checks a model plugin runs in its own tests.

    from diffpipe_core.testing.conformance import check_model_plugin
    check_model_plugin(my_plugin_module, "mymodel", {"type": "mymodel", "path": str(tiny_model_dir)},
                       pixels=torch.rand(2, 3, 64, 64) * 2 - 1, captions=["a cat", "a dog"])

A video model gets ``pixels`` of shape ``(B, 3, F, H, W)``; the kit also runs its first frame as an image
batch (not for a model that requires first frames; a first-frame model gets it as the clips' ``first_frames``; a model
trained on control videos, ``ModelSpec.control_videos``, gets the clips reversed in time as their control videos).
What is checked: that the entry module, ``model_spec`` and the schema import no torch, diffusers or
transformers (in a fresh interpreter); the spec and ``[model]`` schema; ``validate_model_files`` on the tiny
model; ``encode_batch`` on media (with masks) and on
captions (deterministic, batch-first, finite); per-stage loading against a whole load in float32 and
bfloat16 (same tensors, same dtypes); layers that share the model's parameters; ``prepare_inputs`` drawing
all randomness from its generator; the stage-boundary rule at every possible boundary; a finite loss whose
gradient reaches every LoRA weight; and, for a plugin that declares sampling (implements the denoising hooks),
that the core's loop with classifier-free guidance over its layers gives finite pixels of the requested size and
frame count (those of ``pixels``), and, for a plugin that names its ``sample_pipeline``, the same latents as that
diffusers pipeline run on the tiny model from the same noise.

Each check raises AssertionError naming the hook and what is wrong; a rule a contract change added also names its
CHANGELOG entry (:mod:`diffpipe_core.testing.contract_changes`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diffpipe_core.adapters import lora_config
from diffpipe_core.engine.adapter_layers import adapt_layers
from diffpipe_core.engine.model_loading import load_for_stages, materialise_layers, meta_tensors
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.contract_changes import since
from diffpipe_core.testing.imports import check_light_imports
from diffpipe_core.types import EncodeBatch, ModelConfigBase, ModelSpec, SampleRequest, TrainingContext, control_key


def _check_encoded(out: Any, batch_size: int, hook: str) -> dict[str, torch.Tensor]:
    assert isinstance(out, dict) and out, f"{hook} must return a non-empty dict of tensors, got {type(out).__name__}"
    for key, value in out.items():
        assert not key.startswith("_"), f"{hook}: key {key!r} must not start with '_'"
        assert torch.is_tensor(value), f"{hook}: {key!r} is {type(value).__name__}, not a tensor"
        assert value.shape[0] == batch_size, f"{hook}: {key!r} has batch dim {value.shape[0]}, expected {batch_size}"
        assert torch.isfinite(value.float()).all(), f"{hook}: {key!r} holds non-finite values"
    return out


def _run_layers(layers: list[nn.Module], inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x = inputs
    for i, layer in enumerate(layers):
        x = layer(x)
        assert isinstance(x, tuple) and all(torch.is_tensor(t) for t in x), (
            f"split_into_layers: layer {i} ({type(layer).__name__}) must return a tuple of tensors"
        )
    return x


def _check_per_stage_loading(plugin: Any, cfg: ModelConfigBase, dtype: torch.dtype) -> Any:
    """Per-stage loading gives the same tensors, with the same dtypes, as loading the model whole."""
    device = torch.device("cpu")
    stage = load_for_stages(plugin, cfg, device, dtype)
    if not stage.per_stage_loading:
        return stage
    materialise_layers(plugin, cfg, stage, range(len(stage.layers)), device)
    _check_nothing_on_meta(stage.model, "a meta build and per-stage loading")
    full = plugin.require("load_diffusion_model", model_config=cfg, device=device, dtype=dtype)
    _check_nothing_on_meta(full, f"load_diffusion_model(device=cpu, dtype={dtype})")
    mine, theirs = stage.model.state_dict(), full.state_dict()
    assert mine.keys() == theirs.keys(), f"per-stage loading ({dtype}): keys differ from a full load"
    for key in mine:
        assert mine[key].dtype == theirs[key].dtype, (
            f"per-stage loading ({dtype}): {key!r} is {mine[key].dtype}, a full load gives {theirs[key].dtype}"
            + since("bf16_loading")
        )
        assert torch.equal(mine[key], theirs[key]), f"per-stage loading ({dtype}): {key!r} differs from a full load"
    return stage


def _check_nothing_on_meta(model: nn.Module, after: str) -> None:
    left = meta_tensors(model)
    assert not left, (
        f"load_diffusion_model: after {after}, {len(left)} tensors are still on the meta device: {', '.join(left)}. "
        "No weight file fills a buffer or a tensor a module keeps as a plain attribute (a RoPE table): build the "
        "skeleton the way from_pretrained does, parameters on meta and everything else on a real device "
        "(DiffusersModel.build_skeleton does; diffpipe_core.engine.model_loading.parameters_on_meta for your own)"
        + since("meta_tensors")
    )


def _check_layers_share_the_model(model: nn.Module, layers: list[nn.Module]) -> None:
    owned = {id(p) for p in model.parameters()}
    for i, layer in enumerate(layers):
        assert isinstance(layer, nn.Module), f"split_into_layers: layer {i} is not an nn.Module"
        for pname, p in layer.named_parameters():
            assert id(p) in owned, (
                f"split_into_layers: layer {i} ({type(layer).__name__}) holds {pname!r}, which is not the model's "
                "(wrap the model's own submodules and parameters, not copies)" + since("shared_parameters")
            )


def _check_stage_boundaries(layers: list[nn.Module], inputs: tuple[torch.Tensor, ...], loss_of: Any) -> None:
    """At every place a stage boundary could fall, each float tensor crossing it must get a gradient from
    the layers after it, as DeepSpeed's pipeline requires (whatever ``partition_split`` the user picks)."""
    crossing = []
    with torch.no_grad():
        x = tuple(t.clone() for t in inputs)
        for layer in layers[:-1]:
            x = layer(x)
            crossing.append(x)
    for k, outputs in enumerate(crossing):
        leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outputs)
        floats = [i for i, t in enumerate(leaves) if t.is_floating_point()]
        if not floats:
            continue
        loss = loss_of(_run_layers(layers[k + 1 :], leaves))
        grads = torch.autograd.grad(loss, [leaves[i] for i in floats], allow_unused=True)
        for i, grad in zip(floats, grads):
            assert grad is not None, (
                f"split_into_layers: output {i} of layer {k} ({type(layers[k]).__name__}), shape "
                f"{tuple(leaves[i].shape)}, is a float tensor no later layer uses; a pipeline stage boundary after "
                f"layer {k} would fail. Return only tensors later layers use (sizes as integer tensors)"
                + since("stage_boundaries")
            )


def _check_sampling(
    plugin: Any, cfg: ModelConfigBase, layers: list[nn.Module], text: dict[str, torch.Tensor], pixels: torch.Tensor,
    seed: int,
) -> None:
    """The denoising hooks under the core's loop (two steps, CFG with the second caption as the negative prompt, or
    through the unconditional model the spec declares) and the decoder give one finite sample of the requested width,
    height and frame count."""
    from diffpipe_core.sampling.config import missing_sampling_hooks
    from diffpipe_core.sampling.loop import PromptText, generate, noise_generator
    from diffpipe_core.sampling.pipeline import LayerChainForward
    from diffpipe_core.sampling.runner import decode
    from diffpipe_core.sampling.unconditional import unconditional_forward

    if missing_sampling_hooks(plugin):
        return
    video = plugin.spec.modality == "video"
    height, width = pixels.shape[-2], pixels.shape[-1]
    frames = pixels.shape[2] if video else 1
    request = SampleRequest(width=width, height=height, frames=frames, steps=2)
    rows = [{k: v[i : i + 1] for k, v in text.items()} for i in range(min(2, pixels.shape[0]))]
    prompt = PromptText(cond=rows[0], uncond=rows[-1])
    what = f"sampling ({width}x{height}, {frames} frame{'s' if frames > 1 else ''})"
    with unconditional_forward(plugin, cfg, 2.0, torch.device("cpu")) as unconditional:  # a declared one: its model
        (latents,) = generate(plugin, cfg, request, [prompt], [noise_generator(seed, 0)], LayerChainForward(layers),
                              cfg=2.0, unconditional=unconditional)
    assert torch.isfinite(latents).all(), f"{what}: the denoised latents hold non-finite values"
    ((_, out),) = decode(plugin, cfg, {0: latents}, torch.device("cpu"))
    want = (3, frames, height, width) if video else (3, height, width)
    assert tuple(out.shape) == want, (
        f"{what}: decode_latents gave a sample of shape {tuple(out.shape)}; the request needs {want} "
        "(denoise_init's latents must follow request.width, height and frames)"
    )
    assert torch.isfinite(out).all(), f"{what}: decode_latents gave non-finite pixels"


def _check_sample_equals_pipeline(
    plugin_obj: Any, plugin: Any, cfg: ModelConfigBase, layers: list[nn.Module], captions: list[str],
    pixels: torch.Tensor, seed: int,
) -> None:
    """The core's loop over the plugin's layers gives the latents its declared ``sample_pipeline`` gives, from the
    same noise, for the first caption with the second as the negative prompt (all in float32)."""
    from diffpipe_core.sampling.config import missing_sampling_hooks
    from diffpipe_core.sampling.loop import PromptText, generate, noise_generator
    from diffpipe_core.sampling.pipeline import LayerChainForward
    from diffpipe_core.sampling.unconditional import unconditional_forward
    from diffpipe_core.testing.sampling import PIPELINE_CFG, PIPELINE_STEPS, pipeline_sample

    pipeline = getattr(plugin_obj, "sample_pipeline", None)
    if pipeline is None:
        return
    missing = missing_sampling_hooks(plugin)
    assert not missing, f"sample_pipeline is {pipeline!r}, but the plugin does not implement {', '.join(missing)}"
    assert len(captions) >= 2, "give two captions: the kit samples the first with the second as the negative prompt"
    video = plugin.spec.modality == "video"
    frames = pixels.shape[2] if video else 1
    request = SampleRequest(width=pixels.shape[-1], height=pixels.shape[-2], frames=frames, steps=PIPELINE_STEPS)
    if "encoder_dtype" in type(cfg).model_fields:
        cfg = cfg.model_copy(update={"encoder_dtype": "float32"})
    encoders = plugin.require("load_encoders", model_config=cfg, device=torch.device("cpu"))
    # as the core's sampling encodes them (sampling/prompts.py): the negative prompt in a batch of its own, marked
    cond = plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(captions=captions[:1]))
    negative = EncodeBatch(captions=captions[1:2], negative_prompt=True)
    uncond = plugin.require("encode_batch", encoders=encoders, batch=negative)
    prompt = PromptText(cond={k: v[:1] for k, v in cond.items()}, uncond={k: v[:1] for k, v in uncond.items()})
    noise, ours_schedule = plugin.require(
        "denoise_init", request=request, model_config=cfg, generator=noise_generator(seed, 0)
    )
    with torch.no_grad(), unconditional_forward(plugin, cfg, PIPELINE_CFG, torch.device("cpu")) as unconditional:
        (ours,) = generate(plugin, cfg, request, [prompt], [noise_generator(seed, 0)], LayerChainForward(layers),
                           cfg=PIPELINE_CFG, unconditional=unconditional)
    settings = {arg: getattr(cfg, key) for arg, key in getattr(plugin_obj, "sample_pipeline_settings", {}).items()}
    folder = plugin_obj.model_folder(cfg) if hasattr(plugin_obj, "model_folder") else cfg.path  # type: ignore[attr-defined]
    setup = getattr(plugin_obj, "sample_pipeline_setup", None)
    expected, sigmas = pipeline_sample(pipeline, folder, (captions[0], captions[1]), noise, request, settings, setup)
    what = (
        f"sampling: {PIPELINE_STEPS} steps at cfg {PIPELINE_CFG} from the same noise and prompts as {pipeline}"
        f" ({request.width}x{request.height}, {frames} frame{'s' if frames > 1 else ''})"
    )
    assert ours.shape == expected.shape, (
        f"{what}: denoise_init's latents are {tuple(ours.shape)}, {pipeline}'s {tuple(expected.shape)}"
    )
    gap = (ours - expected).abs().max().item()
    if gap > 1e-4 * max(1.0, expected.abs().max().item()):
        yours = [round(float(v), 4) for v in ours_schedule]
        theirs = [round(float(v), 4) for v in sigmas]
        hint = (
            f"denoise_init's schedule {yours} is not the pipeline's sigmas {theirs}: take the model folder's own "
            "scheduler (diffpipe_core.sampling.schedules.stepped_schedule, which FlowSampling steps with)"
            if len(yours) != len(theirs) or any(abs(a - b) > 1e-4 for a, b in zip(yours, theirs))
            else "the schedules agree, so the text encoding, denoise_inputs (the timestep's scale) or guidance differ"
        )
        raise AssertionError(f"{what}: the latents differ by up to {gap:.4g}; {hint}")


def _media_batches(spec: ModelSpec, pixels: torch.Tensor, generator: torch.Generator) -> list[EncodeBatch]:
    """What the core hands ``encode_batch``: images (B, 3, H, W) and, for a video model, also videos
    (B, 3, F, H, W), with their first frames for a first-frame model (which gets no images when it requires first
    frames); masks are (B, 1, H, W) for all."""
    first = None
    if spec.modality == "video":
        assert pixels.dim() == 5, (
            f"for a video model give pixels as (B, 3, F, H, W), got {tuple(pixels.shape)}; the kit also tries frame 0"
            + since("video_pixels")
        )
        media = [pixels] if spec.first_frame == "required" or spec.control_videos else [pixels[:, :, 0], pixels]
        first = pixels[:, :, 0] if spec.first_frame != "none" else None
    else:
        assert pixels.dim() == 4, "for an image model give pixels as (B, 3, H, W)"
        media = [pixels]
    b, h, w = pixels.shape[0], pixels.shape[-2], pixels.shape[-1]
    return [
        EncodeBatch(
            pixels=p,
            masks=torch.rand(b, 1, h, w, generator=generator),
            first_frames=first if p.dim() == 5 else None,
        )
        for p in media
    ]


def check_model_plugin(
    plugin_obj: Any,
    name: str,
    model_table: dict[str, Any],
    pixels: torch.Tensor,
    captions: list[str],
    seed: int = 0,
) -> None:
    """Run every contract check on one model plugin with a tiny model; see the module docstring.

    ``pixels`` in [-1, 1]: ``(B, 3, H, W)`` for an image model, ``(B, 3, F, H, W)`` for a video model (its
    first frame is tried as an image batch too). Every media batch carries a ``(B, 1, H, W)`` mask.
    """
    registry = Registry()
    info = registry.register_model(name, plugin_obj)
    assert info.ok, f"model_spec failed: {info.error}"
    check_light_imports(plugin_obj, name)  # fast start: entry module, model_spec, schema import no torch
    plugin = registry.model(name)
    spec = plugin.spec
    assert isinstance(spec, ModelSpec) and spec.modality in ("image", "video")
    assert issubclass(spec.config_schema, ModelConfigBase), "config_schema must subclass ModelConfigBase"
    assert spec.spatial_multiple > 0 and spec.frame_multiple > 0
    for key in spec.encoder_settings:
        assert key in spec.config_schema.model_fields, f"encoder_settings names unknown [model] key {key!r}"
    cfg = validate(spec.config_schema, model_table, f"[model] of {name}")
    if plugin.has("validate_model_files"):
        problems = plugin.call("validate_model_files", model_config=cfg)
        assert problems == [], f"validate_model_files finds problems in the plugin's own tiny model: {problems}"

    device = torch.device("cpu")
    encoders = plugin.require("load_encoders", model_config=cfg, device=device)
    n = pixels.shape[0]
    assert len(captions) == n, "give one caption per pixel sample"
    generator = torch.Generator().manual_seed(seed)
    medias = []
    for batch in _media_batches(spec, pixels, generator):
        kind = f"encode_batch(pixels {tuple(batch.pixels.shape)}, masks)"
        medias.append(_check_encoded(plugin.require("encode_batch", encoders=encoders, batch=batch), n, kind))
    if spec.control_videos:  # its items are clips paired with control videos: each gets its control's tensors
        control = EncodeBatch(pixels=pixels.flip(2), control_index=0)  # the clips reversed in time as the controls
        encoded = _check_encoded(plugin.require("encode_batch", encoders=encoders, batch=control), n,
                                 f"encode_batch(control videos {tuple(pixels.shape)})")
        medias = [{**m, **{control_key(0, k): v for k, v in encoded.items()}} for m in medias]
    text = _check_encoded(
        plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(captions=captions)),
        n,
        "encode_batch(captions)",
    )
    again = plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(captions=captions))
    for key, value in text.items():
        assert torch.equal(value, again[key]), f"encode_batch: the same caption gave a different {key!r}"
    for media in medias:
        assert not set(media) & set(text), f"media and caption keys overlap: {set(media) & set(text)}"
    del encoders

    _check_per_stage_loading(plugin, cfg, torch.bfloat16)
    stage = _check_per_stage_loading(plugin, cfg, torch.float32)
    model, layers = stage.model, stage.layers
    _check_layers_share_the_model(model, layers)

    context = TrainingContext(model_config=cfg)
    prepared = []
    for media in medias:
        batch = {**media, **text}
        first = plugin.require(
            "prepare_inputs", batch=batch, context=context, generator=torch.Generator().manual_seed(seed)
        )
        second = plugin.require(
            "prepare_inputs", batch=batch, context=context, generator=torch.Generator().manual_seed(seed)
        )
        for a, b in zip(first[0] + first[1], second[0] + second[1]):
            assert torch.equal(a, b), "prepare_inputs must draw all randomness from the generator it is given"
        prepared.append(first)

    def loss_of(targets: tuple[torch.Tensor, ...]) -> Any:
        return lambda outputs: plugin.require("compute_loss", outputs=outputs, targets=targets, context=context)

    inputs, loss_targets = prepared[0]
    _check_stage_boundaries(layers, inputs, loss_of(loss_targets))
    _check_sampling(plugin, cfg, layers, text, pixels, seed)
    _check_sample_equals_pipeline(plugin_obj, plugin, cfg, layers, captions, pixels, seed)

    targets = plugin.require("lora_targets", model_config=cfg)
    check_lora_gradients(model, layers, prepared, list(targets), loss_of)


def check_lora_gradients(
    model: nn.Module,
    layers: list[nn.Module],
    prepared: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]],
    targets: list[str],
    loss_of: Any,
) -> None:
    """LoRA on ``targets`` (``lora_B`` made non-zero), then for each ``(inputs, loss_targets)`` a finite loss whose
    gradient reaches every LoRA weight; a module whose weights get none is named with the cause: never called, its
    output read by nothing that reaches the loss (the last joint block's text side), or its weights cut off."""
    adapt_layers(model, layers, lora_config(4, 4, 0.0, targets), torch.float32)
    with torch.no_grad():
        for n_, p in model.named_parameters():
            if "lora_B" in n_:
                p.normal_(std=0.01)
    for inputs, loss_targets in prepared:
        outputs, watched = _run_watched(model, layers, tuple(t.clone() for t in inputs))
        loss = loss_of(loss_targets)(outputs)
        assert torch.is_tensor(loss) and loss.dim() == 0 and torch.isfinite(loss), f"compute_loss returned {loss!r}"
        model.zero_grad()
        loss.backward()
        lora_params = [(n_, p) for n_, p in model.named_parameters() if "lora_" in n_]
        assert lora_params, f"lora_targets {targets} matched no module"
        without_grad = [n_ for n_, p in lora_params if p.grad is None or not p.grad.abs().sum() > 0]
        assert not without_grad, (
            f"LoRA weights get no gradient through the layers, e.g. {without_grad[:3]}; "
            + "; ".join(_no_gradient_causes(without_grad, watched))
        )


class _Watched:
    """What one LoRA-adapted module did in a forward and backward pass."""

    def __init__(self) -> None:
        self.calls = 0
        self.output_grads: list[torch.Tensor | None] = []


def _run_watched(
    model: nn.Module, layers: list[nn.Module], inputs: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], dict[str, _Watched]]:
    """The layers' outputs, with a forward hook on every LoRA-adapted module recording whether it ran and, after
    ``backward``, whether its output got a gradient (retained on the output tensors)."""
    watched: dict[str, _Watched] = {}
    handles = []

    def hook(name: str):
        def record(module: nn.Module, args: Any, output: Any) -> None:
            entry = watched[name]
            entry.calls += 1
            if torch.is_tensor(output) and output.requires_grad:
                index = len(entry.output_grads)
                entry.output_grads.append(None)
                output.register_hook(lambda g: entry.output_grads.__setitem__(index, g))

        return record

    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            watched[name] = _Watched()
            handles.append(module.register_forward_hook(hook(name)))
    try:
        return _run_layers(layers, inputs), watched
    finally:
        for handle in handles:
            handle.remove()


def _no_gradient_causes(without_grad: list[str], watched: dict[str, _Watched]) -> list[str]:
    """Why each adapted module whose LoRA weights got no gradient got none, one line per module."""
    causes = []
    for module in dict.fromkeys(n.split(".lora_")[0] for n in without_grad):
        entry = watched.get(module)
        if entry is None or entry.calls == 0:
            causes.append(f"{module} is never called by the layers (leave it out of lora_targets)")
        elif all(g is None or not g.abs().sum() > 0 for g in entry.output_grads):
            causes.append(
                f"{module}'s output is used by no later layer: nothing that reaches the loss reads it (the text side "
                "of the last joint block of an MMDiT, whose text stream nothing after that block reads). Leave it out "
                "of lora_targets: DiffusersModel.last_block_unused declares such modules"
            )
        else:
            causes.append(
                f"{module}'s output gets a gradient but its LoRA weights do not (is it called under torch.no_grad, "
                "or on a detached copy of its weights?)"
            )
    return causes
