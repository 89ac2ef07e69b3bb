"""``cosmos-predict2.5`` in-process against diffusers' ``Cosmos2_5_PredictBasePipeline`` on the tiny folder: the text
tensors are its ``encode_prompt``'s, the latents its ``prepare_latents``', the layers chained its transformer's
forward (called as its loop calls it), the samples its text-to-world output for the same noise, steps and guidance
(its UniPC scheduler; images and videos; decoded and written as MP4); per-stage loading; folder checks; the
ComfyUI LoRA keys; the conformance kit."""

from __future__ import annotations

import functools
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.registry import get_registry
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.output import to_uint8, write_sample
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import validate
from diffpipe_core.testing.sampling import assert_same_sample, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_cosmos import resize
from diffpipe_cosmos.predict25 import predict25

NAME, PROMPT, NEGATIVE, STEPS, SEED = "cosmos-predict2.5", "a red cat", "a dark river", 3, 5
WIDTH, HEIGHT, LENGTH = 48, 32, 32  # the chat template takes 22 of them
CPU = torch.device("cpu")
#: (frames, [sample] cfg); the pipeline's guidance_scale is cfg - 1 (it forms cond + s * (cond - uncond))
CASES = [(1, 1.0), (1, 3.5), (5, 1.0)]


def config(path: Path, **kw):
    table = {"type": NAME, "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": LENGTH}
    return validate(predict25.spec.config_schema, {**table, **kw}, "test")


class NoGuardrail:
    """The pipeline refuses to run without NVIDIA's safety checker (another package); given prompt embeddings and
    asked for latents it only moves it between devices."""

    def to(self, *args, **kwargs) -> NoGuardrail:
        return self


@functools.cache
def pipeline(folder: Path):
    from diffusers import Cosmos2_5_PredictBasePipeline

    resize.install()
    return Cosmos2_5_PredictBasePipeline.from_pretrained(str(folder), safety_checker=NoGuardrail(), dtype=torch.float32)


def test_text_tensors_are_the_pipelines_encode_prompt(tiny_predict25: Path) -> None:
    enc = predict25.load_encoders(config(tiny_predict25), CPU)
    captions = ["a red cat", "a photo of a dog on a tree with a river " * 3]  # the second one is truncated
    ours = predict25.encode_batch(enc, EncodeBatch(captions=captions))["text_embeds"]
    theirs, _ = pipeline(tiny_predict25).encode_prompt(
        captions, do_classifier_free_guidance=False, max_sequence_length=LENGTH, device=CPU
    )
    assert ours.shape == (2, LENGTH, 64) and torch.equal(ours, theirs)  # 2 Qwen layers x 32 features
    assert not torch.allclose(ours[0], ours[1])


def test_latents_are_the_pipelines(tiny_predict25: Path) -> None:
    """Clips and images: the pipeline's ``prepare_latents`` of a conditioning video; the sampler's noise: its noise
    for text-to-world (no conditioning frames) from the same generator."""
    pipe, cfg = pipeline(tiny_predict25), config(tiny_predict25)
    enc = predict25.load_encoders(cfg, CPU)
    pixels = torch.rand(2, 3, 5, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ours = predict25.encode_batch(enc, EncodeBatch(pixels=pixels))["latents"]
    with torch.no_grad():
        _, theirs, _, _ = pipe.prepare_latents(pixels, 2, 4, HEIGHT, WIDTH, 5, 5, dtype=torch.float32, device=CPU)
    assert ours.shape == (2, 4, 2, 4, 6) and torch.allclose(ours, theirs, atol=1e-5)
    image = predict25.encode_batch(enc, EncodeBatch(pixels=pixels[:, :, 0]))["latents"]
    with torch.no_grad():
        _, first, _, _ = pipe.prepare_latents(pixels[:, :, :1], 2, 4, HEIGHT, WIDTH, 1, 1, dtype=torch.float32)
    assert image.shape == (2, 4, 1, 4, 6) and torch.allclose(image, first, atol=1e-5)

    request = SampleRequest(width=WIDTH, height=HEIGHT, frames=5, steps=STEPS)
    noise, schedule = predict25.denoise_init(request, cfg, noise_generator(SEED, 0))
    expected, _, mask, _ = pipe.prepare_latents(None, 1, 4, HEIGHT, WIDTH, 0, 5, generator=noise_generator(SEED, 0))
    assert torch.equal(noise, expected) and mask.abs().sum() == 0
    pipe.scheduler.set_timesteps(STEPS)
    assert torch.equal(schedule, pipe.scheduler.sigmas.float())


@pytest.mark.parametrize("frames", [1, 2])
def test_layers_chained_are_the_transformer_forward(tiny_predict25: Path, frames: int) -> None:
    """As the pipeline's loop calls it: the per-frame timestep ``(B, 1, T, 1, 1)``, zero condition and padding
    masks, no frame rate."""
    cfg = config(tiny_predict25)
    model = predict25.load_diffusion_model(cfg, CPU, torch.float32)
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(2, 4, frames, 4, 6, generator=g), "text_embeds": torch.randn(2, LENGTH, 64)}
    inputs, targets = predict25.prepare_inputs(batch, TrainingContext(cfg), torch.Generator().manual_seed(1))
    x = inputs
    with torch.no_grad():
        for layer in predict25.split_into_layers(model, cfg):
            x = layer(x)
        expected = model(
            hidden_states=inputs[0],
            timestep=inputs[1].view(2, 1, 1, 1, 1).expand(2, 1, frames, 1, 1),
            encoder_hidden_states=inputs[2],
            condition_mask=torch.zeros(2, 1, frames, 4, 6),
            padding_mask=torch.zeros(1, 1, HEIGHT, WIDTH),
        ).sample
    assert len(x) == 1 and x[0].shape == (2, 4, frames, 4, 6) == targets[0].shape
    assert torch.allclose(x[0], expected, atol=1e-5), (x[0] - expected).abs().max()


def pipeline_latents(folder: Path, texts, frames: int, cfg: float) -> torch.Tensor:
    noise = torch.randn((1, 4, (frames - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8), generator=noise_generator(SEED, 0))
    kwargs = {"negative_prompt_embeds": texts.uncond["text_embeds"]} if cfg > 1 else {}
    return pipeline(folder)(
        prompt_embeds=texts.cond["text_embeds"],
        latents=noise,
        num_inference_steps=STEPS,
        guidance_scale=cfg - 1 if cfg > 1 else 1.0,
        height=HEIGHT,
        width=WIDTH,
        num_frames=frames,
        output_type="latent",
        **kwargs,
    ).frames


def test_samples_are_the_pipelines_text_to_world(tiny_predict25: Path, tmp_path: Path) -> None:
    import av

    cfg = config(tiny_predict25)
    plugin = get_registry().model(NAME)
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], NEGATIVE, CPU)
    samples = {}
    for frames, scale in CASES:
        request = SampleRequest(width=WIDTH, height=HEIGHT, frames=frames, steps=STEPS)
        ours = sample_latents(plugin, cfg, request, texts, SEED, scale)
        noise = predict25.denoise_init(request, cfg, noise_generator(SEED, 0))[0]
        assert_same_sample(ours, pipeline_latents(tiny_predict25, texts, frames, scale), noise)
        samples[(frames, scale)] = ours
    assert not torch.allclose(samples[CASES[0]], samples[CASES[1]])  # guidance changed the sample

    latents = samples[CASES[-1]]
    ((_, pixels),) = decode(plugin, cfg, {0: latents}, CPU)
    vae = pipeline(tiny_predict25).vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    with torch.no_grad():  # the pipeline's decode: latents / (1 / std) + mean
        want = vae.decode(latents / (1.0 / std) + mean).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, 5, HEIGHT, WIDTH)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
    file = write_sample(tmp_path / "sample", to_uint8(pixels), float(predict25.spec.video_fps))
    with av.open(str(file)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == Fraction(16)
        assert [f.to_ndarray(format="rgb24").shape for f in container.decode(stream)] == [(HEIGHT, WIDTH, 3)] * 5


def test_per_stage_loading_reads_only_the_stages_tensors(tiny_predict25: Path) -> None:
    from diffpipe_core.testing.stage_reads import assert_stages_read_their_own

    first, second = (
        set(s.reads) for s in assert_stages_read_their_own(get_registry().model(NAME), config(tiny_predict25))
    )
    assert "crossattn_proj.0.weight" in first and "transformer_blocks.0.attn1.to_q.weight" in first
    assert "proj_out.weight" in second and "transformer_blocks.0.attn1.to_q.weight" not in second


def test_folder_checks(tiny_predict25: Path, tmp_path: Path) -> None:
    import json
    import shutil

    assert predict25.validate_model_files(config(tiny_predict25)) == []
    single = tmp_path / "x.safetensors"
    single.write_bytes(b"")
    problems = predict25.validate_model_files(config(tiny_predict25, diffusion_model=single))
    assert problems and any("no original single-file layout" in p or "x.safetensors" in p for p in problems)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_predict25, broken)
    file = broken / "transformer" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "crossattn_proj_in_channels": 100352}))
    (problem,) = predict25.validate_model_files(config(broken))
    assert problem.startswith(f"{file}: crossattn_proj_in_channels 100352") and "need 64" in problem


def test_comfyui_lora_keys_are_predict2s_native_names() -> None:
    """ComfyUI's key map takes ``diffusion_model.<module>`` for its model's modules, NVIDIA's names (Predict2's
    blocks, which 2.5's are), with ``.alpha``: every attention and MLP linear of every block."""
    from diffpipe_core.adapters import apply_lora, lora_config, lora_state_dict
    from diffpipe_cosmos.plugin import LORA_TARGETS
    from diffpipe_cosmos.testing_predict25 import TinyPredict25Config, transformer

    model = transformer(TinyPredict25Config())
    apply_lora(model, lora_config(4, 6.0, 0.0, list(LORA_TARGETS)))
    comfy = predict25.export_adapter(state_dict=lora_state_dict(model), alpha=6.0, rank=4, format="comfyui")
    native = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.output_proj",
        "cross_attn.q_proj",
        "cross_attn.k_proj",
        "cross_attn.v_proj",
        "cross_attn.output_proj",
        "mlp.layer1",
        "mlp.layer2",
    ]
    stems = {f"diffusion_model.blocks.{i}.{m}" for i in range(2) for m in native}
    assert set(comfy) == {f"{s}.{k}" for s in stems for k in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert all(float(comfy[f"{s}.alpha"]) == 6.0 for s in stems)


def test_conformance(tiny_predict25: Path) -> None:
    from diffpipe_core.testing.conformance import check_model_plugin

    table = {
        "type": NAME,
        "path": tiny_predict25,
        "dtype": "float32",
        "encoder_dtype": "float32",
        "text_max_length": LENGTH,
    }
    pixels = torch.rand(2, 3, 5, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(predict25, NAME, table, pixels=pixels, captions=["a red cat", "a robot arm walking"])
