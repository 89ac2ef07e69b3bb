"""Qwen-Image 2.1's one shared training run (the CLI: DeepSpeed, the real cache, peft; 1 process) trains with the loss
falling and samples before its first step, and a short 2-stage run in 2 processes from its cache draws the same
losses; the saved diffusers LoRA loads through ``QwenImage21Pipeline.load_lora_weights`` and reproduces the trained
transformer; the ComfyUI file is loaded whole by ComfyUI's Qwen-Image 2.1 key map and applies like the trained
LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.comfy import KeyTarget, apply_file
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_qwenimage.testing21 import comfy_path, load_pipeline, write_tiny_qwen21

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, TWO_STAGE_STEPS = 4, 8.0, 20, 6
SAMPLE = {"prompts": ["a red cat"], "negative_prompt": "blurry", "cfg": 3.0, "steps": 2, "before_first_step": True}


def run_config(steps: int, stages: int = 1, sample: dict | None = SAMPLE, **top: object) -> str:
    model = {"type": "qwen-image-2.1", "text_max_length": 16, "timestep_sample_method": "uniform"}
    top = {"max_steps": steps, "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3, **top}
    return runs.lora_run_toml(model, 2e-2, sample, RANK, ALPHA, **top)


@pytest.fixture(scope="module")
def qwen21_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared training run of ``qwen-image-2.1`` through the CLI (1 process): a tiny model, 4 captioned 32x32
    images, LoRA saved as diffusers and ComfyUI files, a CFG sample before the first step. Its run folder."""
    root = tmp_path_factory.mktemp("qwen21-train")
    write_tiny_qwen21(root / "model")
    captions = ["a red cat", "a blue dog", "a green tree", "a small house"]
    write_image_dataset(root / "data", 4, size=(32, 32), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[32], enable_ar_bucket=False)
    (root / "run.toml").write_text(run_config(STEPS))
    return runs.train(root, "run.toml", 1)


@pytest.fixture(scope="module")
def qwen21_two_stages(qwen21_run: Path) -> Path:
    """The same project on 2 pipeline stages in 2 processes, 6 steps from the 1-process run's cache, no samples."""
    root = qwen21_run.parent.parent
    (root / "run2.toml").write_text(run_config(TWO_STAGE_STEPS, 2, None, partition_split=[2]))
    return runs.train(root, "run2.toml", 2)


def test_trains_on_two_stages_as_on_one(qwen21_two_stages: Path, qwen21_run: Path) -> None:
    runs.assert_trained_in_stages(qwen21_two_stages, TWO_STAGE_STEPS, 2)
    one_process = runs.losses(qwen21_run)[:TWO_STAGE_STEPS]
    assert runs.losses(qwen21_two_stages) == pytest.approx(one_process, rel=1e-4)


def test_the_loss_falls_and_a_sample_is_written(qwen21_run: Path) -> None:
    runs.assert_loss_falls(qwen21_run, STEPS, 5)
    names = sorted(p.name for p in (qwen21_run / "samples" / "step-0000000").iterdir())
    assert "00-a-red-cat.png" in names, names


def transformer_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    slots = torch.cat([torch.zeros(2, 6, dtype=torch.bool), torch.ones(2, 2, dtype=torch.bool)], dim=1)
    return {
        "hidden_states": torch.randn(2, 8, 4, generator=g),
        "encoder_hidden_states": torch.randn(2, 6, 32, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(2, generator=g),
        "img_shapes": [[(1, 2, 4)]] * 2,
        "img_mask": slots,
    }


def test_diffusers_lora_loads_in_the_pipeline_and_reproduces(qwen21_run: Path) -> None:
    from diffusers import QwenImage21Transformer2DModel

    model_dir, saved = qwen21_run.parent.parent / "model", qwen21_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding=(
        "transformer_blocks.1.img_mlp.gate_layer.lora_A.weight", "transformer_blocks.0.attn.to_out.0.lora_B.weight"))
    reference = runs.with_trained_lora(
        QwenImage21Transformer2DModel.from_pretrained(str(model_dir / "transformer")), qwen21_run, RANK, ALPHA,
        cfg["target_modules"],
    )
    pipe = load_pipeline(model_dir)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(), ALPHA)


def comfy_qwen21_key_map(native: dict[str, torch.Tensor]) -> dict[str, KeyTarget]:
    """ComfyUI's LoRA key map of a Qwen-Image 2.1 model (``comfy/lora.py`` ``model_lora_keys_unet``, Comfy-Org/ComfyUI
    17358c8f: its ``QwenImage`` branch, which ``QwenImage21`` inherits) over ComfyUI's own state dict, whose MLP holds
    ``img_mlp.gate_up`` (``gate_layer`` rows, then ``proj``'s, fused at load): for each weight the module name bare
    and under ``transformer.``, ``gate_up``'s two halves by their diffusers names; plus the generic
    ``diffusion_model.<module>`` of every weight."""
    out: dict[str, KeyTarget] = {}
    for key, value in native.items():
        module, weight = key.removesuffix(".weight"), f"diffusion_model.{key}"
        out[f"diffusion_model.{module}"] = weight
        targets: list[tuple[str, KeyTarget]] = [(module, weight)]
        if module.endswith(".img_mlp.gate_up"):
            half = value.shape[0] // 2
            targets = [(module.replace(".gate_up", ".gate_layer"), (weight, (0, 0, half), None)),
                       (module.replace(".gate_up", ".proj"), (weight, (0, half, half), None))]
        for name, target in targets:
            out[name] = out[f"transformer.{name}"] = target
    return out


def comfy_native(diffusers_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen-Image 2.1 state dict as ComfyUI holds it after loading the file (``fused_mlp``: ``img_mlp.gate_up``)."""
    out = {}
    for key, value in diffusers_state.items():
        if key.endswith(".img_mlp.proj.weight"):
            continue
        if key.endswith(".img_mlp.gate_layer.weight"):
            proj = diffusers_state[key.replace(".gate_layer.", ".proj.")]
            out[key.replace(".gate_layer.", ".gate_up.")] = torch.cat([value, proj])
        else:
            out[key] = value
    return out


def test_comfyui_lora_is_loaded_whole_by_comfyuis_key_map(qwen21_run: Path) -> None:
    comfy = load_file(str(qwen21_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    base = load_file(str(comfy_path(qwen21_run.parent.parent / "model")))  # model.diffusion_model.<diffusers name>
    weights = {k.removeprefix("model.diffusion_model."): v for k, v in base.items()}
    params = runs.checkpoint_params(qwen21_run)
    modules = sorted({k.split(".lora_A.")[0] for k in params if ".lora_A." in k})
    want = {f"transformer.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert set(comfy) == want and float(comfy["transformer.transformer_blocks.0.img_mlp.proj.alpha"]) == RANK  # folded
    native = comfy_native(weights)
    got = apply_file({f"diffusion_model.{k}": v for k, v in native.items()}, comfy, comfy_qwen21_key_map(native))
    merged = comfy_native(runs.merge_peft(weights, params, ALPHA / RANK))
    runs.assert_state_close({k.removeprefix("diffusion_model."): v for k, v in got.items()}, merged, atol=1e-5)
    blocks = 2  # each block's gate_layer and proj LoRAs patch one fused gate_up
    assert sum(not torch.equal(got[f"diffusion_model.{k}"], native[k]) for k in native) == len(modules) - blocks


@pytest.mark.slow
def test_component_files_train_as_the_folder(qwen21_run: Path) -> None:
    """The shared run again from ComfyUI's files only (the transformer under ``model.diffusion_model.``, the VAE and
    Qwen3-VL files) beside a config-only folder (issue 35): equal losses and LoRA files."""
    from diffpipe_core.testing.component_files import assert_trains_as, comfyui_files, model_keys, train_from_files

    root = qwen21_run.parent.parent
    files = comfyui_files(root / "model", root / "comfy")
    (root / "run_files.toml").write_text(run_config(STEPS, output_dir="out_files"))
    assert_trains_as(train_from_files(root, root / "run_files.toml", model_keys(files)), qwen21_run)
