"""Flux Kontext (issue 19, tests 3 and 4): the training inputs of an edit pair equal what ``FluxKontextPipeline``
builds (the control image's packed latents appended to the target's, its position ids with first axis 1), the loss
covers the target's tokens only, and a tiny Kontext trains on a dataset of edit pairs and plain images on 2 pipeline
stages and on 1 process; its diffusers LoRA loads in ``FluxKontextPipeline`` and reproduces the trained transformer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core import TrainingContext
from diffpipe_core.adapters import read_adapter
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_png
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import control_key
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.kontext import plugin as kontext
from diffpipe_flux.packing import image_ids, pack, text_ids
from diffpipe_flux.testing import TinyFluxConfig, pipeline_latents, write_tiny_flux

RANK, ALPHA, STEPS = 4, 8.0, 12
MODEL = {"type": "flux-kontext", "t5_max_length": 8, "timestep_sample_method": "uniform"}
SAMPLE = {"prompts": ["make it red", "a plain dog"], "control_images": ["control/e0.jpg", []]}
SAMPLE |= {"before_first_step": True, "steps": 2}


def test_inputs_equal_the_kontext_pipelines(tiny_flux: Path) -> None:
    from diffusers import FluxKontextPipeline

    cfg = validate(FluxConfig, {"type": "flux-kontext", "path": tiny_flux, "dtype": "float32"}, "test")
    g = torch.Generator().manual_seed(0)
    target, control = torch.randn(2, 4, 8, 6, generator=g), torch.randn(2, 4, 4, 6, generator=g)
    batch = {
        "latents": target,
        control_key(0, "latents"): control,
        "t5_embeds": torch.randn(2, 16, 32),
        "clip_pooled": torch.randn(2, 32),
    }
    (x, t, text, pooled, guidance, ids, txt_ids), (velocity,) = kontext.prepare_inputs(
        batch, TrainingContext(cfg), torch.Generator().manual_seed(1)
    )
    pipe = FluxKontextPipeline.from_pretrained(str(tiny_flux), local_files_only=True)
    noisy, image_latents, latent_ids, image_ids_ = pipe.prepare_latents(
        control, 2, 4, 64, 48, torch.float32, torch.device("cpu"), latents=pack(target)
    )
    assert torch.equal(x[:, noisy.shape[1] :], image_latents)  # the control tokens, packed as the pipeline packs
    assert torch.equal(ids.float(), torch.cat([latent_ids, image_ids_]))
    assert x.shape[1] == 12 + 6 and velocity.shape == (2, 12, 16) and torch.equal(txt_ids, text_ids(16))
    assert torch.equal(ids[:12], image_ids(8, 6))
    # the loss covers the target's tokens: a prediction wrong only on the control's tokens costs nothing
    prediction = torch.cat([velocity, torch.full((2, 6, 16), 100.0)], dim=1)
    assert kontext.compute_loss((prediction,), (velocity,), TrainingContext(cfg)) == 0


def make_project(root: Path) -> Path:
    write_tiny_flux(root / "model", TinyFluxConfig())
    for folder in ("edit", "control", "plain"):
        (root / folder).mkdir()
    for i in range(4):
        write_png(root / "edit" / f"e{i}.png", 32, 32, seed=i)
        (root / "edit" / f"e{i}.txt").write_text(f"a red cat {i}", encoding="utf-8")
        write_png(root / "control" / f"e{i}.jpg", 48, 32, seed=40 + i)  # another aspect ratio: cropped
        write_png(root / "plain" / f"p{i}.png", 32, 32, seed=20 + i)
        (root / "plain" / f"p{i}.txt").write_text(f"a blue dog {i}", encoding="utf-8")
    (root / "dataset.toml").write_text(
        'resolutions = [32]\n[[directory]]\npath = "edit"\ncontrol_path = "control"\n[[directory]]\npath = "plain"\n'
    )
    for stages in (1, 2):  # the 2-stage run also samples, with a control image for its first prompt
        sample = SAMPLE if stages == 2 else None
        top = {"output_dir": f"out{stages}", "max_steps": STEPS, "pipeline_stages": stages, "seed": 3}
        (root / f"run{stages}.toml").write_text(runs.lora_run_toml(MODEL, 4e-3, sample, RANK, ALPHA, **top))
    return root


@pytest.fixture(scope="module")
def kontext_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The 2-stage run (caches the edit pairs) and the 1-process run (reuses the cache)."""
    root = make_project(tmp_path_factory.mktemp("kontext"))
    return {stages: runs.train(root, f"run{stages}.toml", stages) for stages in (2, 1)}


@pytest.mark.slow
def test_kontext_trains_on_edit_pairs_on_one_and_two_stages(kontext_runs: dict[int, Path]) -> None:
    for stages, run in kontext_runs.items():
        runs.assert_loss_falls(run, STEPS, 3, factor=0.95)
        assert len(runs.stage_files(run)) == stages
    # the pipeline split changes nothing: same data, noise and weights
    assert runs.losses(kontext_runs[1]) == pytest.approx(runs.losses(kontext_runs[2]), rel=1e-4)


@pytest.mark.slow
def test_kontext_samples_during_training_with_a_control_image(kontext_runs: dict[int, Path]) -> None:
    folder = kontext_runs[2] / "samples" / "step-0000000"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "00-make-it-red.png",
        "01-a-plain-dog.png",
        "contact-sheet.png",
        "latents.safetensors",
        "prompts.json",
    ], names


def test_sample_control_images_are_checked(tmp_path: Path) -> None:
    from diffpipe_core.registry import Registry
    from diffpipe_core.sampling.config import SampleConfig, sample_problems
    from diffpipe_flux.plugin import plugin as flux

    registry = Registry()
    assert registry.register_model("flux-kontext", kontext).ok and registry.register_model("flux", flux).ok
    edit, plain = registry.model("flux-kontext"), registry.model("flux")
    image = write_png(tmp_path / "c.png", 32, 32)

    def problems(plugin, **table) -> list[str]:
        return sample_problems(SampleConfig(**table), plugin, "run.toml", when=False)

    assert any("1 entries for 2 prompts" in p for p in problems(edit, prompts=["a", "b"], control_images=[image]))
    missing = problems(edit, prompts=["a"], control_images=[tmp_path / "nope.png"])
    assert any("file not found" in p and "nope.png" in p for p in missing), missing
    assert problems(edit, prompts=["a"], control_images=[image]) == []
    assert any("takes no control images" in p for p in problems(plain, prompts=["a"], control_images=[image]))


@pytest.mark.slow
def test_kontext_lora_loads_in_the_kontext_pipeline_and_reproduces(kontext_runs: dict[int, Path]) -> None:
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel

    run = kontext_runs[2]
    model_dir, saved = run.parent.parent / "model", run / "saved" / "final"
    _, cfg = read_adapter(saved)
    reference = runs.with_trained_lora(
        FluxTransformer2DModel.from_pretrained(str(model_dir / "transformer")), run, RANK, ALPHA, cfg["target_modules"]
    )
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 16 + 8, 16, generator=g),  # target and control tokens
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "pooled_projections": torch.randn(2, 32, generator=g),
        "timestep": torch.rand(2, generator=g),
        "guidance": torch.ones(2),
        "img_ids": torch.cat([image_ids(8, 8), image_ids(4, 8) + torch.tensor([1, 0, 0])]).float(),
        "txt_ids": text_ids(8).float(),
    }
    # the ComfyUI file is Flux's (BFL names, fused q/k/v with alpha scaled): ComfyUI loads Kontext LoRAs as Flux ones
    from safetensors.torch import load_file

    comfy = load_file(str(saved / "adapter_model.comfyui.safetensors"))
    assert float(comfy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"]) == 3 * RANK
    assert all(
        k.startswith("diffusion_model.double_blocks.") or k.startswith("diffusion_model.single_blocks.") for k in comfy
    )
    pipe = FluxKontextPipeline.from_pretrained(str(model_dir), local_files_only=True)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, inputs)


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_kontext_sample_with_a_control_image_equals_the_pipeline(tiny_flux: Path, tmp_path: Path, cfg_scale) -> None:
    """``[sample] control_images``: the prompt's control image encoded as in training and appended; the latents equal
    ``FluxKontextPipeline``'s for the same noise, prompt embeddings, control latents, steps and guidance."""
    from diffusers import FluxKontextPipeline

    from diffpipe_core.sampling.loop import noise_generator
    from diffpipe_core.sampling.prompts import encode_prompts
    from diffpipe_core.types import SampleRequest

    plugin = registered(kontext, "flux-kontext")
    control = write_png(tmp_path / "control.png", 96, 64, seed=3)  # center-cropped to the 64x64 sample
    cfg = validate(
        FluxConfig,
        {
            "type": "flux-kontext",
            "path": tiny_flux,
            "dtype": "float32",
            "encoder_dtype": "float32",
            "t5_max_length": 16,
        },
        "test",
    )
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, ["make it red"], negative, torch.device("cpu"), [[control]], (64, 64))
    image_latents = texts.cond[control_key(0, "latents")]
    assert image_latents.shape == (1, 4, 8, 8)
    request = SampleRequest(width=64, height=64, steps=3)
    ours = sample_latents(plugin, cfg, request, texts, 5, cfg_scale)

    pipe = FluxKontextPipeline.from_pretrained(str(tiny_flux), local_files_only=True)
    noise = torch.randn((1, 4, 8, 8), generator=noise_generator(5, 0))
    expected = pipeline_latents(pipe, texts, noise, 3, cfg_scale, image=image_latents, max_area=64 * 64)
    assert_same_sample(ours, expected, noise)


@pytest.mark.slow
def test_comfyui_loads_the_kontext_diffusers_file_at_the_trained_strength(kontext_runs: dict[int, Path]) -> None:
    """ComfyUI loads a Kontext LoRA as a Flux one: the diffusers-format file through Flux's ``transformer.<diffusers
    name>`` key map, with no ``.alpha`` (scale 1), into the BFL layout's fused weights."""
    import json

    from safetensors.torch import load_file
    from test_flux_lokr import comfy_flux_key_map

    from diffpipe_core.testing.comfy import apply_file, assert_applies_as_trained
    from diffpipe_flux.bfl import bfl_to_diffusers, diffusers_to_bfl

    run = kontext_runs[2]
    folder = run.parent.parent / "model" / "transformer"
    config = json.loads((folder / "config.json").read_text())
    original = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    lora = load_file(str(run / "saved" / "final" / "adapter_model.safetensors"))
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    key_map = comfy_flux_key_map(config["num_layers"], config["num_single_layers"], hidden)
    applied = bfl_to_diffusers(apply_file(diffusers_to_bfl(original), lora, key_map))
    trained = runs.merge_peft(original, runs.checkpoint_params(run), ALPHA / RANK)
    assert_applies_as_trained(applied, trained, original)


@pytest.mark.slow
def test_component_files_train_as_the_folder(kontext_runs: dict[int, Path]) -> None:
    """The 1-process run again from ComfyUI's files only (issue 35): BFL's transformer, the LDM VAE, CLIP and T5 beside
    a folder of configs: equal losses and LoRA files."""
    from test_flux_component_files import comfy_files

    from diffpipe_core.testing.component_files import assert_trains_as, model_keys, train_from_files

    root = kontext_runs[1].parent.parent
    files = comfy_files(root / "model", root / "comfy")
    config = root / "run1_files.toml"
    config.write_text((root / "run1.toml").read_text().replace("output_dir = 'out1'", "output_dir = 'out1_files'"))
    assert_trains_as(train_from_files(root, config, model_keys(files)), kontext_runs[1])

