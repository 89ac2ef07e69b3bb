"""End-to-end through the real CLI (DeepSpeed on gloo, the real cache, peft), issue points 2 and 4.

One project (a tiny LTX-Video, 4 generated mp4 clips and 4 PNG images) trains twice, sharing its cache:
2 pipeline stages from the diffusers folder (per-stage loading, first-frame conditioning p = 0.5, LoRA saved in
the diffusers and ComfyUI formats), and 1 process from the original-layout single file (p = 1). The loss falls in
both; the diffusers LoRA loads through ``LTXPipeline.load_lora_weights`` and reproduces the trained transformer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import diffpipe_core.testing.runs as run_checks
from diffpipe_core.testing.golden import assert_matches
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_ltx.testing import single_file_path, write_clips, write_tiny_ltx

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8.0
MODEL = {"type": "ltx-video", "t5_max_length": 16, "timestep_sample_method": "uniform"}
CAPTIONS = ["a red car", "a blue river", "a green tree", "a dark city", "a cat", "a dog", "a house", "a sky"]
TWO_STAGE_STEPS, ONE_PROC_STEPS = 20, 16

GOLDEN = Path(__file__).parent / "golden"  # saved/final of these runs (golden.py: bytes, or values on another CPU)


def make_project(root: Path) -> Path:
    write_tiny_ltx(root / "model")
    data = root / "data"
    write_image_dataset(data, 4, size=(96, 64), captions=CAPTIONS[4:])
    write_clips(data, CAPTIONS[:4], frames=12, size=(96, 64))
    write_dataset_toml(
        root / "dataset.toml", data, resolutions=[[96, 64]], enable_ar_bucket=False, frame_buckets=[1, 9]
    )
    return root


def train(root: Path, name: str, stages: int, procs: int, steps: int, p: float, single_file: bool) -> Path:
    model = {**MODEL, "first_frame_conditioning_p": p}
    if single_file:
        model["diffusion_model"] = single_file_path(root / "model").name
    top = {"output_dir": name, "max_steps": steps, "gradient_accumulation_steps": 2, "pipeline_stages": stages}
    if stages == 2:  # embedders + block 0 | block 1 + output: the boundary carries every between-block tensor
        top["partition_split"] = [2]
    text = run_checks.lora_run_toml(model, 1e-2, None, RANK, ALPHA, checkpoint_every_n_steps=steps, seed=3, **top)
    (root / f"{name}.toml").write_text(text)
    return run_checks.train(root, f"{name}.toml", procs, timeout=400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 2-stage run (caches first) and the 1-process single-file run (reuses that cache)."""
    root = make_project(tmp_path_factory.mktemp("ltx_project"))
    return {
        "two_stages": train(root, "two", stages=2, procs=2, steps=TWO_STAGE_STEPS, p=0.5, single_file=False),
        "one_proc": train(root, "one", stages=1, procs=1, steps=ONE_PROC_STEPS, p=1.0, single_file=True),
    }


def assert_loss_falls(run: Path, steps: int) -> None:
    run_checks.assert_loss_falls(run, steps, steps // 4)


def test_two_pipeline_stages_train_on_clips_and_images(runs: dict[str, Path]) -> None:
    run = runs["two_stages"]
    assert_loss_falls(run, TWO_STAGE_STEPS)
    assert run_checks.stage_files(run) == ["params-stage0.safetensors", "params-stage1.safetensors"]
    # both kinds of media were cached: 9-frame clips (2 latent frames) and images (1 latent frame), 64x96 pixels
    from diffpipe_core.data.cache_store import list_shards

    tables = {arrow.parent.parent for arrow in (run.parent.parent / "cache").rglob("data.arrow")}
    shapes = {s.columns["latents"][0] for t in tables for s in list_shards(t) if "latents" in s.columns}
    assert shapes == {(8, 1, 2, 3), (8, 2, 2, 3)}, shapes


def test_one_process_from_single_file_with_first_frame_conditioning(runs: dict[str, Path]) -> None:
    assert_loss_falls(runs["one_proc"], ONE_PROC_STEPS)


@pytest.mark.parametrize("name", ["two_stages", "one_proc"])
def test_saved_lora_files_are_the_golden_ones(runs: dict[str, Path], name: str) -> None:
    golden = {"two_stages": "two_stages.json", "one_proc": "one_process_single_file.json"}[name]
    assert_matches(runs[name] / "saved" / "final", GOLDEN / golden)


def trained_reference(run: Path, model_dir: Path, target_modules: list[str]):
    """The transformer with the trained LoRA tensors of the last checkpoint, applied by peft."""
    from diffusers import LTXVideoTransformer3DModel

    trained = ("transformer_blocks.1.attn2.to_k.lora_A.default.weight",)
    return run_checks.trained_transformer(
        LTXVideoTransformer3DModel, run, model_dir, RANK, ALPHA, target_modules, trained
    )


def transformer_inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(2, 12, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 16, 32, generator=g),
        "timestep": torch.rand(2, generator=g) * 1000,
        "encoder_attention_mask": torch.ones(2, 16),
        "num_frames": 2,
        "height": 2,
        "width": 3,
        "rope_interpolation_scale": (8 / 25, 32, 32),
    }


def test_diffusers_lora_loads_in_ltx_pipeline_and_reproduces(runs: dict[str, Path]) -> None:
    from diffusers import LTXPipeline

    run = runs["two_stages"]
    model_dir = run.parent.parent / "model"
    saved = run / "saved" / "final"
    state, cfg = run_checks.read_saved_lora(saved, RANK, ALPHA)
    assert "transformer.transformer_blocks.0.attn1.to_q.lora_A.weight" in state
    assert "transformer.transformer_blocks.1.ff.net.2.lora_B.weight" in state
    reference = trained_reference(run, model_dir, cfg["target_modules"])

    pipe = LTXPipeline.from_pretrained(str(model_dir), local_files_only=True)
    untrained = run_checks.outputs(pipe.transformer, transformer_inputs())
    run_checks.load_lora_into(pipe, saved / "adapter_model.safetensors")
    # alpha != rank: reproducing the outputs also shows diffusers applied the trained strength
    got = run_checks.outputs(pipe.transformer, transformer_inputs())
    run_checks.assert_reproduces(got, run_checks.outputs(reference, transformer_inputs()), untrained)


def test_comfyui_file_has_native_keys_and_alpha(runs: dict[str, Path]) -> None:
    run = runs["two_stages"]
    comfy = load_file(str(run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    diffusers_file = load_file(str(run / "saved" / "final" / "adapter_model.safetensors"))
    modules = {k[len("transformer.") : -len(".lora_A.weight")] for k in diffusers_file if k.endswith(".lora_A.weight")}
    assert len(modules) == 2 * (2 * 4 + 2)  # 2 blocks x (attn1 + attn2 q/k/v/out, ff in/out)
    expected = {f"diffusion_model.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert set(comfy) == expected
    for m in modules:
        assert torch.equal(
            comfy[f"diffusion_model.{m}.lora_B.weight"], diffusers_file[f"transformer.{m}.lora_B.weight"]
        )
        assert float(comfy[f"diffusion_model.{m}.alpha"]) == RANK


def test_component_files_train_as_the_single_file(runs: dict[str, Path]) -> None:
    """The 1-process run again from ComfyUI's files only (issue 35): the checkpoint holding the transformer and VAE,
    and the T5 file, beside a folder of configs: equal losses and LoRA files."""
    from test_ltx_component_files import comfy_files

    from diffpipe_core.testing.component_files import assert_trains_as, train_from_files

    root = runs["one_proc"].parent.parent
    comfy = comfy_files(root / "model", root / "comfy")
    keys = {"path": str(comfy["configs"]), "diffusion_model": str(comfy["checkpoint"]), "vae": str(comfy["checkpoint"])}
    config = root / "one_files.toml"
    config.write_text((root / "one.toml").read_text().replace("output_dir = 'one'", "output_dir = 'one_files'"))
    run = train_from_files(root, config, {**keys, "text_encoders": [str(comfy["t5"])]})
    assert_trains_as(run, runs["one_proc"])

