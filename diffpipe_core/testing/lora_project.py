"""The tiny LoRA project an image model plugin's run tests share, and the checks each such plugin makes on its runs.

A plugin's tests build one project (:func:`make_project`: the tiny model, 4 captioned 32x32 images, a 1-process LoRA
run config from :func:`run_config`), run it once per session, and check with :func:`assert_two_stage_lora_reproduces`
that a run on 2 pipeline stages saved a diffusers LoRA the pipeline's ``load_lora_weights`` applies as trained, and
with :func:`assert_comfyui_file_applies` that the ComfyUI file holds only names ComfyUI's key map accepts and applies
to the native weights like the separate LoRAs::

    def make_project(root):
        return lora_project.make_project(root, write_tiny_lumina2, lora_project.run_config(MODEL, 3e-2, STEPS))
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from diffpipe_core.testing import comfy, runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset

CAPTIONS = ("a red cat", "a blue dog", "a green tree", "a small house")
COMFY_FILE, DIFFUSERS_FILE = "adapter_model.comfyui.safetensors", "adapter_model.safetensors"


def run_config(model: Mapping[str, Any], lr: float, steps: int, rank: int = 4, alpha: float = 8.0, **top: Any) -> str:
    """A LoRA run config: 1 process, micro-batches of 4, ``steps`` steps and one checkpoint at the end, seed 7;
    ``top`` changes the top-level keys."""
    top = {"micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "pipeline_stages": 1, "seed": 7, **top}
    top = {"max_steps": steps, "checkpoint_every_n_steps": steps, **top}
    return runs.lora_run_toml(dict(model), lr, None, rank, alpha, **top)


def make_project(root: Path, write_model: Callable[[Path], Any], run_toml: str, size: int = 32) -> Path:
    """The tiny model (``write_model(root / "model")``), 4 captioned ``size`` x ``size`` images and ``run.toml`` in
    ``root``."""
    root = Path(root)
    write_model(root / "model")
    write_image_dataset(root / "data", len(CAPTIONS), size=(size, size), captions=list(CAPTIONS))
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[size], enable_ar_bucket=False)
    (root / "run.toml").write_text(run_toml)
    return root


def copy_of(folder: Path, single_file: Callable[[Path], Path]) -> Callable[[Path], None]:
    """A ``write_model`` for :func:`make_project` that copies the session's tiny model instead of writing another:
    ``folder`` and its original-layout file ``single_file(folder)`` (beside the copy, where ``single_file`` puts it)."""

    def copy(target: Path) -> None:
        shutil.copytree(folder, target)
        shutil.copy2(single_file(folder), single_file(target))

    return copy


def two_stage_run(root: Path, make: Callable[[Path], Path], run_toml: str) -> Path:
    """``make(root)``'s project with ``run_toml`` (2 pipeline stages), trained in 2 processes; its run folder."""
    root = make(root)
    (root / "run.toml").write_text(run_toml)
    return runs.train(root, "run.toml", 2, timeout=600, OMP_NUM_THREADS="1")


def assert_two_stage_lora_reproduces(
    run: Path, steps: int, transformer_class: Any, pipeline_class: Any, rank: int, alpha: float, inputs: dict
) -> None:
    """Run ``run`` trained ``steps`` steps on 2 stages (each saved its share), and its diffusers LoRA, loaded with
    ``pipeline_class.load_lora_weights``, makes the transformer give the trained model's outputs on ``inputs``."""
    from diffpipe_core.adapters import read_adapter

    runs.assert_trained_in_stages(run, steps, 2)
    model_dir, saved = run.parent.parent / "model", run / "saved" / "final"
    _, cfg = read_adapter(saved)
    fresh = transformer_class.from_pretrained(str(model_dir / "transformer"))
    reference = runs.with_trained_lora(fresh, run, rank, alpha, cfg["target_modules"])
    pipe = pipeline_class.from_pretrained(str(model_dir), local_files_only=True)
    runs.assert_lora_reproduces(pipe, saved / DIFFUSERS_FILE, reference, inputs)


def assert_comfyui_file_applies(
    run: Path, native: Mapping[str, Any], to_model: Callable[[dict], dict], rank: int, alpha: float
) -> tuple[dict, set[str]]:
    """Run ``run``'s ComfyUI LoRA holds only names ComfyUI's generic key map of the ``native`` weights (the model's
    own names, no prefix) accepts, and applied to them as ComfyUI applies it, then read back into the model's keys
    by ``to_model`` (which takes keys under ``diffusion_model.``), equals the folder's transformer with the run's
    trained LoRA merged (alpha / rank). Returns the file and its module stems."""
    from safetensors.torch import load_file

    file = load_file(str(run / "saved" / "final" / COMFY_FILE))
    key_map = comfy.generic_key_map(native)  # ComfyUI's model_lora_keys_unet over its model's weights
    stems = set(comfy.group_by_stem(file))
    assert stems <= set(key_map), sorted(stems - set(key_map))[:3]
    applied = comfy.apply_file({f"diffusion_model.{k}": v for k, v in native.items()}, file, key_map)
    base = load_file(str(run.parent.parent / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))
    merged = runs.merge_peft(base, runs.checkpoint_params(run), alpha / rank)
    runs.assert_state_close(to_model(applied), merged, atol=1e-5)
    return file, stems
