"""Cosmos samples (issue 21): the plugins' denoising hooks under the core's loop equal the diffusers pipelines for the
same tiny model, noise, prompt embeddings, steps and guidance (with and without classifier-free guidance), decoded
videos included, written as MP4 at the model's frame rate: ``cosmos`` against ``CosmosTextToWorldPipeline`` (EDM),
``cosmos-predict2`` against ``Cosmos2TextToImagePipeline`` for images and, for videos, against that pipeline's loop
over video latents with the frame rate ``Cosmos2VideoToWorldPipeline`` gives the transformer (video-to-world without
conditioning frames). And the shared 2-stage ``cosmos-predict2`` run samples through the pipeline engine what the
pipeline makes."""

from __future__ import annotations

import functools
import hashlib
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from cosmos_common import config
from safetensors.torch import load_file

from diffpipe_core.registry import get_registry
from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.output import to_uint8, write_sample
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.types import SampleRequest
from diffpipe_cosmos import resize

PROMPT, NEGATIVE, STEPS, SEED = "a red cat", "a dark river", 3, 5
WIDTH, HEIGHT = 48, 32
FPS = {"cosmos": 30, "cosmos-predict2": 16}  # the pipelines' defaults: CosmosTextToWorld, Cosmos2VideoToWorld
# (frames, [sample] cfg); the pipelines' guidance_scale is cfg - 1 (they form cond + s * (cond - uncond))
CASES = {"cosmos": [(9, 1.0), (9, 3.5)], "cosmos-predict2": [(1, 1.0), (1, 3.5), (5, 1.0)]}


class NoGuardrail:
    """The pipelines refuse to run without NVIDIA's safety checker (another package); with prompt embeddings and
    latent output they only move it between devices."""

    def to(self, *args, **kwargs) -> NoGuardrail:
        return self


@functools.cache
def reference(name: str, folder: Path):
    """The prompt's text tensors (the plugin's encoders) and the diffusers pipeline of the model in ``folder``."""
    import diffusers
    from transformers import AutoTokenizer

    (texts,) = encode_prompts(get_registry().model(name), config(name, folder), [PROMPT], NEGATIVE, torch.device("cpu"))
    cls = diffusers.CosmosTextToWorldPipeline if name == "cosmos" else diffusers.Cosmos2TextToImagePipeline
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))  # the tiny one is word-level, not T5's
    return texts, cls.from_pretrained(
        str(folder), safety_checker=NoGuardrail(), tokenizer=tokenizer, dtype=torch.float32
    )


@functools.cache
def pipeline_latents(name: str, folder: Path, frames: int, cfg: float) -> torch.Tensor:
    """The pipeline's final latents from the same noise and prompt embeddings (read at its last step: the
    text-to-image pipeline returns only the first latent frame)."""
    resize.install()
    texts, pipe = reference(name, folder)
    fps = FPS[name]
    latent_frames = (frames - 1) // (8 if name == "cosmos" else 4) + 1
    noise = torch.randn((1, 4, latent_frames, HEIGHT // 8, WIDTH // 8), generator=noise_generator(SEED, 0))
    final = {}
    kwargs = {"num_frames": frames, "fps": fps} if name == "cosmos" else {}
    if cfg > 1:
        kwargs["negative_prompt_embeds"] = texts.uncond["t5_embeds"]
    transformer_forward = pipe.transformer.forward
    if name == "cosmos-predict2" and frames > 1:  # the video-to-world pipeline gives videos their frame rate
        pipe.transformer.forward = lambda *a, **kw: transformer_forward(*a, **kw, fps=fps)
    try:
        pipe(
            prompt_embeds=texts.cond["t5_embeds"],
            latents=noise,
            num_inference_steps=STEPS,
            guidance_scale=cfg - 1 if cfg > 1 else 1.0,
            height=HEIGHT,
            width=WIDTH,
            output_type="latent",
            callback_on_step_end=lambda p, i, t, kw: final.update(kw) or {},
            **kwargs,
        )
    finally:
        pipe.transformer.forward = transformer_forward
    return final["latents"]


@pytest.mark.parametrize("name", ["cosmos", "cosmos-predict2"])
def test_samples_equal_the_pipeline(tiny_models: dict[str, Path], name: str, tmp_path: Path) -> None:
    import av

    plugin, cfg, folder = get_registry().model(name), config(name, tiny_models[name]), tiny_models[name]
    texts, pipe = reference(name, folder)
    model = plugin.require("load_diffusion_model", model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)
    forward = LayerChainForward(plugin.require("split_into_layers", model=model, model_config=cfg))
    samples = {}
    for frames, cfg_scale in CASES[name]:
        request = SampleRequest(width=WIDTH, height=HEIGHT, frames=frames, steps=STEPS)
        (ours,) = generate(plugin, cfg, request, [texts], [noise_generator(SEED, 0)], forward, cfg=cfg_scale)
        torch.testing.assert_close(ours, pipeline_latents(name, folder, frames, cfg_scale), rtol=1e-4, atol=1e-4)
        assert ours.abs().max() < 20, "the latents were not denoised from sigma_max = 80"
        samples[(frames, cfg_scale)] = ours
    assert not torch.allclose(samples[CASES[name][0]], samples[CASES[name][1]])  # guidance changed the sample

    # decoding as the pipelines do: latents * std / sigma_data + mean (per channel, and per frame for 1.0)
    frames, latents = CASES[name][-1][0], samples[CASES[name][-1]]
    ((_, pixels),) = decode(plugin, cfg, {0: latents}, torch.device("cpu"))
    assert pixels.shape == (3, frames, HEIGHT, WIDTH)
    c, sigma_data = pipe.vae.config, 0.5 if name == "cosmos" else 1.0
    mean = torch.tensor(c.latents_mean).view(1, 4, -1, 1, 1)[:, :, : latents.shape[2]]
    std = torch.tensor(c.latents_std).view(1, 4, -1, 1, 1)[:, :, : latents.shape[2]]
    with torch.no_grad():
        want = pipe.vae.decode(latents * std / sigma_data + mean).sample[0].clamp(-1, 1)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
    # written as the sampler writes it: an MP4 at the model's frame rate (30 and 16 fps)
    file = write_sample(tmp_path / "sample", to_uint8(pixels), float(plugin.spec.video_fps))
    with av.open(str(file)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == Fraction(FPS[name])
        assert [f.to_ndarray(format="rgb24").shape for f in container.decode(stream)] == [(HEIGHT, WIDTH, 3)] * frames


def _file_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.safetensors")
    }


@pytest.mark.slow
def test_two_stage_run_samples_what_the_pipeline_makes(predict2_run: Path, tiny_models: dict[str, Path]) -> None:
    """The shared 2-stage ``cosmos-predict2`` run (conftest.py) samples before its first step (LoRA B = 0): an MP4 of
    the default 5 frames at 16 fps, whose latents, made through the pipeline engine, are the pipeline's."""
    import av

    folder = predict2_run / "samples" / "step-0000000"
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["00-a-red-cat.mp4", "contact-sheet.png", "latents.safetensors", "prompts.json"], files
    with av.open(str(folder / "00-a-red-cat.mp4")) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == Fraction(16) and len(list(container.decode(stream))) == 5
    # the run's model is the session's tiny model (the same files), whose pipeline the test above ran
    model_dir = predict2_run.parent.parent / "model"
    assert _file_hashes(model_dir) == _file_hashes(tiny_models["cosmos-predict2"])
    got = load_file(str(folder / "latents.safetensors"))["sample_00"]
    expected = pipeline_latents("cosmos-predict2", tiny_models["cosmos-predict2"], 5, 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
