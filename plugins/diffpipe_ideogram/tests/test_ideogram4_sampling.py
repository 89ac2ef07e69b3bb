"""Ideogram 4 samples: the plugin's denoising hooks under the core's loop equal ``Ideogram4Pipeline``'s for the same
tiny model, noise and prompt at guidance 1 (the pipeline encoding its prompt itself, left padding and all; its
resolution-aware logit-normal schedule), the decoded image included, and equal the modular pipeline's
(``Ideogram4AutoBlocks``, its text-encoding block included); a sample's noise is the pipeline's own draw for the seed;
at ``cfg > 1`` the samples equal the pipeline's guided ones, its second transformer (the folder's, or ComfyUI's
unconditional file) running the negative branch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from diffpipe_core.sampling.config import SampleConfig
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import (
    assert_same_sample,
    float32_config,
    prompt_sample,
    registered,
    sample_latents,
)
from diffpipe_core.types import SampleRequest
from diffpipe_ideogram.config import Ideogram4Config
from diffpipe_ideogram.plugin import plugin, tokens, unpatchify, untokens
from diffpipe_ideogram.testing import load_pipeline, unconditional_comfy_path

PROMPT, STEPS, SEED, SIZE, LENGTH, GUIDANCE = "a red cat on a house", 3, 5, 64, 32, 2.5
REQUEST = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)


def config(path: Path, **keys: object):
    return float32_config(Ideogram4Config, path, text_max_length=LENGTH, **keys)


def test_sample_equals_the_pipeline_and_the_modular_pipeline(tiny_ideogram4: Path) -> None:
    from diffusers.modular_pipelines import Ideogram4AutoBlocks

    model = registered(plugin, "ideogram4")
    cfg = config(tiny_ideogram4)
    ours = prompt_sample(model, cfg, PROMPT, None, REQUEST, SEED)
    noise, _ = plugin.denoise_init(REQUEST, cfg, noise_generator(SEED, 0))

    pipe = load_pipeline(tiny_ideogram4)
    call = {"height": SIZE, "width": SIZE, "num_inference_steps": STEPS, "max_sequence_length": LENGTH}
    with torch.no_grad():  # the pipeline's own noise for the seed: the tokens the plugin's noise holds
        out = pipe(prompt=PROMPT, guidance_scale=1.0, guidance_schedule=None, output_type="latent",
                   generator=noise_generator(SEED, 0), **call).images
    assert_same_sample(ours, untokens(out, 4, 4), noise)

    blocks = Ideogram4AutoBlocks().init_pipeline()
    blocks.update_components(**{n: getattr(pipe, n) for n in ("transformer", "unconditional_transformer", "vae",
                                                              "text_encoder", "tokenizer", "scheduler")})
    with torch.no_grad():
        modular = blocks(prompt=PROMPT, latents=tokens(noise), guidance_schedule=[1.0] * STEPS, output="latents",
                         **call)
    assert_same_sample(unpatchify(ours), modular, unpatchify(noise))

    ((_, pixels),) = decode(model, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        image = pipe(prompt=PROMPT, guidance_scale=1.0, guidance_schedule=None, output_type="pt",
                     latents=tokens(noise), **call).images[0]
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels / 2 + 0.5, image, rtol=1e-4, atol=1e-5)


def test_guided_sample_equals_the_pipeline_through_its_unconditional_transformer(tiny_ideogram4: Path) -> None:
    """``cfg = 2.5``: the negative branch is the folder's ``unconditional_transformer`` on the image tokens alone (no
    negative prompt encoded), combined as ``Ideogram4Pipeline(guidance_scale=2.5)`` combines it: the latents and the
    decoded image equal the pipeline's. The same model given as ComfyUI's unconditional file (Ideogram's original
    layout, fused qkv) samples the same; plain CFG through the trained transformer would not."""
    model = registered(plugin, "ideogram4")
    cfg = config(tiny_ideogram4)
    (texts,) = encode_prompts(model, cfg, [PROMPT], None, torch.device("cpu"))
    ours = sample_latents(model, cfg, REQUEST, texts, SEED, cfg_scale=GUIDANCE)
    noise, _ = plugin.denoise_init(REQUEST, cfg, noise_generator(SEED, 0))

    pipe = load_pipeline(tiny_ideogram4)
    call = {"height": SIZE, "width": SIZE, "num_inference_steps": STEPS, "max_sequence_length": LENGTH,
            "guidance_scale": GUIDANCE, "guidance_schedule": None}
    with torch.no_grad():
        out = pipe(prompt=PROMPT, output_type="latent", generator=noise_generator(SEED, 0), **call).images
        image = pipe(prompt=PROMPT, output_type="pt", latents=tokens(noise), **call).images[0]
    assert_same_sample(ours, untokens(out, 4, 4), noise)
    # the two hooks as the core calls them: on meta, the skeleton of the folder's unconditional transformer; the
    # unconditional branch's inputs are the conditional branch's without the text tokens
    meta = model.require("load_unconditional_model", model_config=cfg, device=torch.device("meta"),
                         dtype=torch.float32)  # fmt: skip
    shipped = pipe.unconditional_transformer
    assert type(meta) is type(shipped) and all(p.is_meta for p in meta.parameters())
    assert sum(p.numel() for p in meta.parameters()) == sum(p.numel() for p in shipped.parameters())
    schedule = torch.tensor([1.0, 0.5, 0.0])
    uncond = model.require("unconditional_inputs", latents=noise, schedule=schedule, index=1, request=REQUEST,
                           model_config=cfg)  # fmt: skip
    cond = plugin.denoise_inputs(noise, schedule, 1, texts.cond, REQUEST, cfg)
    assert sum(t.numel() for t in uncond) < sum(t.numel() for t in cond)
    ((_, pixels),) = decode(model, cfg, {0: ours}, torch.device("cpu"))
    torch.testing.assert_close(pixels / 2 + 0.5, image, rtol=1e-4, atol=1e-5)

    from_file = config(tiny_ideogram4, unconditional_model=unconditional_comfy_path(tiny_ideogram4))
    assert model.require("validate_model_files", model_config=from_file) == []
    absent = config(tiny_ideogram4, unconditional_model=tiny_ideogram4.parent / "absent.safetensors")
    (line,) = model.require("validate_model_files", model_config=absent)
    assert line.startswith("[model] unconditional_model: ") and "absent.safetensors: not found" in line, line
    torch.testing.assert_close(sample_latents(model, from_file, REQUEST, texts, SEED, cfg_scale=GUIDANCE), ours)
    plain = registered(Ideogram4Guided(), "ideogram4")  # the trained transformer on a negative prompt instead
    (with_negative,) = encode_prompts(plain, cfg, [PROMPT], "", torch.device("cpu"))
    assert (sample_latents(plain, cfg, REQUEST, with_negative, SEED, cfg_scale=GUIDANCE) - ours).abs().max() > 1e-2


class Ideogram4Guided(type(plugin)):  # type: ignore[misc]
    """Ideogram 4 without the declaration: plain CFG through the trained transformer."""

    spec = dataclasses.replace(plugin.spec, unconditional_model=None)


def test_the_stage_plan_counts_the_unconditional_transformer_only_for_guided_samples(tiny_ideogram4: Path) -> None:
    """The plan's line for the last stage holds the unconditional transformer's weights (from its skeleton on meta,
    reading no weight) beside the stage's weights and state when ``[sample] cfg > 1``; with ``cfg = 1`` there is none
    (nor is it loaded)."""
    from types import SimpleNamespace

    from diffpipe_core.engine.plan_build import unconditional_line
    from diffpipe_core.engine.stage_plan import StageEstimate, StagePlan, _mib

    model, cfg = registered(plugin, "ideogram4"), config(tiny_ideogram4)
    held = load_pipeline(tiny_ideogram4).unconditional_transformer.state_dict().values()
    want = sum(t.numel() * t.element_size() for t in held)
    plan = StagePlan("explicit", [0, 4], [StageEstimate(0, 0, 4, ["EmbedLayer"], 10, 1000, 0, 100, 50, 0, 1)], "none")
    for scale in (1.0, GUIDANCE):
        run = SimpleNamespace(run=SimpleNamespace(sample=SampleConfig(prompts=[PROMPT], cfg=scale)), model=cfg)
        line = unconditional_line(plan, run, model)  # type: ignore[arg-type]
        assert line == (None if scale == 1.0 else (
            f"  sampling (cfg 2.5): stage 0 also holds unconditional_transformer, +{_mib(want)} while sampling (host "
            f"memory otherwise): {_mib(1100 + want)} with its weights and state"))
