"""FLUX.2 [dev] and [klein] end-to-end through the real CLI (DeepSpeed on gloo, the real cache, peft), on one shared
1-process run per entry point (conftest.py ``flux2_run``, ``run_dir``; from the BFL / ComfyUI single file): the loss
falls and every default LoRA target trained; the saved diffusers LoRA loads through the pipeline's
``load_lora_weights`` and reproduces the trained transformer; the ComfyUI file has the keys ComfyUI's key map takes
for FLUX.2 (``diffusion_model.`` + the original module names, fused q/k/v, with ``.alpha``) and applies to the
original weights like the separate LoRAs; the run's first sample is the pipeline's for the base model and the same
noise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_flux.flux2_latents import image_ids, text_ids
from diffpipe_flux.testing import bfl_path, comfy_lora_keys, write_tiny_flux2, write_tiny_klein

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, PROMPT, SEED = 4, 8.0, 16, "a red cat", 5
#: per entry point: the pipeline, the tiny model's writer, the text length (the template and the caption fit)
VARIANTS = {
    "flux2-klein": ("Flux2KleinPipeline", write_tiny_klein, 24),
    "flux2": ("Flux2Pipeline", write_tiny_flux2, 48),
}
CAPTIONS = ["a red cat", "a blue dog", "a green tree", "a small house", "a dark river", "a bright sky"]


def make_project(root: Path, variant: str, stages: int = 1) -> Path:
    _, write, length = VARIANTS[variant]
    write(root / "model")
    write_image_dataset(root / "images", 6, size=(32, 32), captions=CAPTIONS)
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[32])
    model = {"type": variant, "diffusion_model": "model.bfl.safetensors", "text_max_length": length}
    sample = {"prompts": [PROMPT], "before_first_step": True, "every_n_steps": STEPS, "steps": 2, "seed": SEED}
    toml = runs.lora_run_toml(
        {**model, "timestep_sample_method": "uniform"}, 3e-2, {**sample, "resolution": 32}, RANK, ALPHA,
        max_steps=STEPS, pipeline_stages=stages, gradient_accumulation_steps=2, checkpoint_every_n_steps=STEPS, seed=7,
    )
    (root / "run.toml").write_text(toml)
    return root / "run.toml"


@pytest.fixture(params=list(VARIANTS))
def run(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """``(entry point, its shared run)``."""
    return request.param, request.getfixturevalue("klein_run" if request.param == "flux2-klein" else "flux2_run")


def model_dir(run: Path) -> Path:
    return run.parent.parent / "model"


def test_loss_falls_and_every_target_trained(run) -> None:
    _, run_dir = run
    runs.assert_loss_falls(run_dir, STEPS, 4)
    stages = 2 if run[0] == "flux2" else 1  # the dev run is the 2-stage one (conftest.py)
    assert runs.stage_files(run_dir) == [f"params-stage{i}.safetensors" for i in range(stages)]
    ups = {k: v for k, v in runs.checkpoint_params(run_dir).items() if ".lora_B." in k}
    assert len(ups) == 2 * 12 + 2 * 2  # 12 linears per double block, 2 per single block (2 + 2 blocks)
    assert all(v.abs().max() > 0 for v in ups.values()), [k for k, v in ups.items() if not v.abs().max() > 0]


def transformer_inputs(variant: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    guidance = {"guidance": torch.full((2,), 2.0)} if variant == "flux2" else {}
    return {
        **guidance,
        "hidden_states": torch.randn(2, 4, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 8, 48, generator=g),
        "timestep": torch.rand(2, generator=g),
        "img_ids": image_ids(2, 2)[None],
        "txt_ids": text_ids(8)[None],
    }


def test_diffusers_lora_loads_in_the_pipeline_and_reproduces(run) -> None:
    import diffusers
    from diffusers import Flux2Transformer2DModel

    variant, run_dir = run
    saved = run_dir / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    assert "transformer.single_transformer_blocks.1.attn.to_out.lora_B.weight" in state
    assert not any(k.startswith(("transformer.proj_out", "transformer.double_stream")) for k in state)
    targets = cfg["target_modules"]
    reference = runs.trained_transformer(Flux2Transformer2DModel, run_dir, model_dir(run_dir), RANK, ALPHA, targets, ())

    pipe = getattr(diffusers, VARIANTS[variant][0]).from_pretrained(str(model_dir(run_dir)), local_files_only=True)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(variant))


def test_comfyui_lora_keys_and_fused_weights(run) -> None:
    from diffpipe_flux.flux2_keys import flux2_layout

    variant, run_dir = run
    comfy = load_file(str(run_dir / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    assert set(comfy) == comfy_lora_keys(2, 2)
    assert float(comfy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"]) == 3 * RANK
    assert float(comfy["diffusion_model.single_blocks.0.linear1.alpha"]) == RANK
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight"].shape == (3 * 32, 3 * RANK)

    # applied to the original weights as ComfyUI does, it equals the trained LoRAs merged one by one
    base = load_file(str(bfl_path(model_dir(run_dir))))
    original = load_file(str(model_dir(run_dir) / "transformer" / "diffusion_pytorch_model.safetensors"))
    merged = runs.merge_peft(original, runs.checkpoint_params(run_dir), ALPHA / RANK)
    table = flux2_layout(2, 2, variant == "flux2", 32)
    runs.assert_state_close(table.to_model(runs.apply_comfyui(base, comfy), "applied"), merged)


def pipeline_latents(variant: str, path: Path, text_embeds: torch.Tensor, size: int, steps: int) -> torch.Tensor:
    """The pipeline's ``output_type="latent"`` result from the same noise (on the patch grid, as its
    ``prepare_latents`` draws it) and prompt embeddings: Klein without CFG, dev at its default guidance."""
    import diffusers

    from diffpipe_core.sampling.loop import noise_generator

    pipe = getattr(diffusers, VARIANTS[variant][0]).from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True
    )
    n = size // 16
    noise = torch.randn((1, 16, n, n), generator=noise_generator(SEED, 0))
    guidance = {"guidance_scale": 1.0} if variant == "flux2-klein" else {}
    return pipe(
        prompt_embeds=text_embeds, latents=noise, num_inference_steps=steps, height=size, width=size,
        output_type="latent", **guidance,
    ).images  # fmt: skip


def test_first_sample_is_the_pipelines(run) -> None:
    from diffusers import AutoencoderKLFlux2

    from diffpipe_core.registry import get_registry
    from diffpipe_core.sampling.prompts import encode_prompts
    from diffpipe_core.schema import validate
    from diffpipe_flux.flux2 import klein
    from diffpipe_flux.flux2_latents import tokens

    variant, run_dir = run
    folders = sorted(p.name for p in (run_dir / "samples").iterdir())
    assert folders == ["step-0000000", f"step-{STEPS:07d}"]
    first, last = (load_file(str(run_dir / "samples" / f / "latents.safetensors"))["sample_00"] for f in folders)
    model = model_dir(run_dir)
    plugin = get_registry().model(variant)
    table = {"type": variant, "path": model, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": VARIANTS[variant][2]}  # fmt: skip
    cfg = validate(plugin.spec.config_schema, table, "test")
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], None, torch.device("cpu"))
    expected = pipeline_latents(variant, model, texts.cond["text_embeds"], size=32, steps=2)
    vae = AutoencoderKLFlux2.from_pretrained(str(model / "vae"), local_files_only=True)
    # Klein's "latent" output is what the VAE decodes; dev's the final tokens, still normalised
    ours = klein.denormalize(first, vae) if variant == "flux2-klein" else tokens(first)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert (first - last).abs().max() > 1e-3  # the LoRA trained between them
