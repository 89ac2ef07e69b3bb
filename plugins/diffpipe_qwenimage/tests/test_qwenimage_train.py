"""Issue 23, test 3 (text-to-image): the shared CLI run (DeepSpeed, the real cache, peft; 1 process) trains with the
loss falling and samples with true CFG before its first step, and a short 2-stage run in 2 processes from its cache
draws the same losses; the saved diffusers LoRA loads through ``QwenImagePipeline.load_lora_weights`` and
reproduces the trained transformer; the ComfyUI file holds exactly the keys ComfyUI's key map takes for Qwen-Image
(``diffusion_model.<diffusers module>`` with lora_A, lora_B and alpha) and applies to the ComfyUI-layout weights
like the separate LoRAs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import comfy, runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_qwenimage.testing import comfy_path, load_pipeline, write_tiny_qwen

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 20
SAMPLE = {"prompts": ["a red cat"], "negative_prompt": "blurry", "cfg": 3.0, "steps": 2, "before_first_step": True}


def run_config(steps: int, stages: int = 1, sample: dict | None = SAMPLE, **top: object) -> str:
    """The run config of the project: ``steps`` steps on ``stages`` pipeline stages, sampling as ``sample`` says."""
    model = {"type": "qwen-image", "text_max_length": 16, "timestep_sample_method": "uniform"}
    top = {"max_steps": steps, "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3, **top}
    return runs.lora_run_toml(model, 2e-2, sample, RANK, ALPHA, **top)


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared training run of ``qwen-image`` through the CLI (1 process): a tiny model, 4 captioned 32x32
    images, LoRA saved as diffusers and ComfyUI files, a true-CFG sample before the first step. Its run folder."""
    root = tmp_path_factory.mktemp("qwen-train")
    return runs.train(root, write_project(root), 1)


def write_project(root: Path) -> Path:
    """The tiny model, 4 captioned 32x32 images and the 1-process ``run.toml`` of :func:`qwen_run`."""
    write_tiny_qwen(root / "model")
    captions = ["a red cat", "a blue dog", "a green tree", "a small house"]
    write_image_dataset(root / "data", 4, size=(32, 32), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[32], enable_ar_bucket=False)
    (root / "run.toml").write_text(run_config(STEPS))
    return root / "run.toml"


TWO_STAGE_STEPS = 6


@pytest.fixture(scope="module")
def qwen_two_stages(qwen_run: Path) -> Path:
    """The same project on 2 pipeline stages in 2 processes, 6 steps from the 1-process run's cache, no samples."""
    root = qwen_run.parent.parent
    (root / "run2.toml").write_text(run_config(TWO_STAGE_STEPS, 2, None, partition_split=[2]))
    return runs.train(root, "run2.toml", 2)


def test_text_to_image_trains_on_two_stages_as_on_one(qwen_two_stages: Path, qwen_run: Path) -> None:
    runs.assert_trained_in_stages(qwen_two_stages, TWO_STAGE_STEPS, 2)
    # same data, noise and initial weights: the split changes nothing (a constant learning rate)
    one_process = runs.losses(qwen_run)[:TWO_STAGE_STEPS]
    assert runs.losses(qwen_two_stages) == pytest.approx(one_process, rel=1e-4)


TEXT_SIDE = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def test_the_loss_falls_and_a_true_cfg_sample_is_written(qwen_run: Path) -> None:
    runs.assert_loss_falls(qwen_run, STEPS, 5)
    names = sorted(p.name for p in (qwen_run / "samples" / "step-0000000").iterdir())
    assert "00-a-red-cat.png" in names, names


def transformer_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return {
        "hidden_states": torch.randn(2, 4, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 6, 32, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(2, generator=g),
        "img_shapes": [[(1, 2, 2)]] * 2,
    }


def test_diffusers_lora_loads_in_qwen_image_pipeline_and_reproduces(qwen_run: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    model_dir, saved = qwen_run.parent.parent / "model", qwen_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    assert all(k.startswith("transformer.transformer_blocks.") for k in state)
    # the last block's text side is left out (nothing reads its output); the first block's is trained
    last = [k for k in state if k.startswith("transformer.transformer_blocks.1.")]
    assert last and not [k for k in last if any(s in k for s in TEXT_SIDE)]
    assert "transformer.transformer_blocks.0.txt_mlp.net.2.lora_B.weight" in state
    assert "transformer.transformer_blocks.1.img_mlp.net.2.lora_B.weight" in state
    reference = runs.with_trained_lora(
        QwenImageTransformer2DModel.from_pretrained(str(model_dir / "transformer")), qwen_run, RANK, ALPHA,
        cfg["target_modules"],
    )
    pipe = load_pipeline(model_dir)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(), ALPHA)


def comfyui_applies_the_diffusers_file(run: Path, alpha: float, rank: int) -> None:
    """ComfyUI loads the diffusers-format file of Qwen-Image (and -Edit: the same model class) through its
    ``transformer.<module>`` key map, with no ``.alpha`` (scale 1): every module, at the trained strength."""
    original = load_file(str(run.parent.parent / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))
    lora = load_file(str(run / "saved" / "final" / "adapter_model.safetensors"))
    held = {f"diffusion_model.{k}": v for k, v in original.items()}
    applied = comfy.apply_file(held, lora, comfy.transformer_names_key_map(original))  # raises on a key left out
    trained = runs.merge_peft({k: v.float() for k, v in original.items()}, runs.checkpoint_params(run), alpha / rank)
    comfy.assert_applies_as_trained({k[len("diffusion_model.") :]: v for k, v in applied.items()}, trained, original)


def test_comfyui_loads_the_diffusers_file_at_the_trained_strength(qwen_run: Path) -> None:
    comfyui_applies_the_diffusers_file(qwen_run, ALPHA, RANK)


def test_comfyui_lora_has_comfyuis_keys_and_applies_like_the_separate_loras(qwen_run: Path) -> None:
    comfy = load_file(str(qwen_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    base = load_file(str(comfy_path(qwen_run.parent.parent / "model")))  # ComfyUI's file: model.diffusion_model.<name>
    native = {k.removeprefix("model.diffusion_model."): v for k, v in base.items()}
    params = runs.checkpoint_params(qwen_run)
    modules = sorted({k.split(".lora_A.")[0] for k in params if ".lora_A." in k})
    # ComfyUI's QwenImage key map: "diffusion_model.<name>" for every "<name>.weight" of the model; the loader reads
    # "<stem>.lora_A.weight", "<stem>.lora_B.weight" and the "<stem>.alpha" scalar
    want = {f"diffusion_model.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert set(comfy) == want and all(f"{m}.weight" in native for m in modules)
    assert float(comfy["diffusion_model.transformer_blocks.0.attn.to_q.alpha"]) == RANK
    assert comfy["diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight"].shape == (RANK, 32)
    got = runs.apply_comfyui(native, comfy)
    merged = runs.merge_peft(native, params, ALPHA / RANK)
    runs.assert_state_close(got, merged)
    assert sum(not torch.equal(got[k], native[k]) for k in native) == len(modules)


@pytest.mark.slow
def test_component_files_train_as_the_folder(qwen_run: Path, tmp_path: Path) -> None:
    """The shared run (the diffusers folder), again from ComfyUI's files only (issue 35): equal losses and LoRA
    files."""
    from test_qwenimage_component_files import comfy_files

    from diffpipe_core.testing.component_files import assert_trains_as, model_keys, train_from_files

    files = comfy_files(write_project(tmp_path).parent / "model", tmp_path / "comfy")
    assert_trains_as(train_from_files(tmp_path, tmp_path / "run.toml", model_keys(files)), qwen_run)
