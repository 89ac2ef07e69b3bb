"""End to end through the real CLI (DeepSpeed on gloo, the real cache, peft), on the one shared run (conftest's
``ernie_run``): the loss falls; the saved diffusers LoRA loads through ErnieImagePipeline.load_lora_weights and
reproduces the trained transformer; the ComfyUI file holds exactly the module names ComfyUI's ErnieImage key map
accepts (``diffusion_model.<diffusers name>``, with alpha) and, applied as ComfyUI applies it, gives the trained
weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import comfy, runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_ernie.plugin import BLOCK_LINEARS
from diffpipe_ernie.testing import write_tiny_ernie

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 12
MODEL = {"type": "ernie-image", "text_max_length": 16}


def run_config(model: dict = MODEL, **top: object) -> str:
    """The project's run config: 1 process, micro-batches of 4, ``STEPS`` steps; ``top`` changes the top-level keys."""
    top = {"micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "pipeline_stages": 1, "seed": 7, **top}
    top = {"max_steps": STEPS, "checkpoint_every_n_steps": STEPS, **top}
    return runs.lora_run_toml(model, 1e-2, None, RANK, ALPHA, **top)


def make_project(root: Path) -> Path:
    """The tiny model, 4 captioned 32x32 images (captions of different lengths) and ``run.toml`` in ``root``."""
    write_tiny_ernie(root / "model")
    captions = ["a red cat", "a blue dog on a tree", "a green tree", "a small house in the city"]
    write_image_dataset(root / "data", 4, size=(32, 32), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[32], enable_ar_bucket=False)
    (root / "run.toml").write_text(run_config())
    return root


def test_loss_falls(ernie_run: Path) -> None:
    runs.assert_loss_falls(ernie_run, STEPS, window=3)
    assert runs.stage_files(ernie_run) == ["params-stage0.safetensors"]


def transformer_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(2, 16, 4, 4, generator=g), "timestep": torch.rand(2, generator=g) * 1000,
            "text_bth": torch.randn(2, 9, 24, generator=g), "text_lens": torch.tensor([9, 4])}


def test_diffusers_lora_loads_in_ernie_pipeline_and_reproduces(ernie_run: Path) -> None:
    from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel

    model_dir = ernie_run.parent.parent / "model"
    saved = ernie_run / "saved" / "final"
    holding = ("layers.1.mlp.linear_fc2.lora_B.weight", "layers.0.self_attention.to_q.lora_A.weight")
    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding)
    reference = runs.with_trained_lora(
        ErnieImageTransformer2DModel.from_pretrained(str(model_dir / "transformer")), ernie_run, RANK, ALPHA,
        cfg["target_modules"],
    )
    pipe = ErnieImagePipeline.from_pretrained(str(model_dir), local_files_only=True)
    untrained = runs.outputs(pipe.transformer, transformer_inputs())
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    # trained with alpha != rank, saved folded: reproducing the outputs proves the strength arrives
    got = runs.outputs(pipe.transformer, transformer_inputs())
    runs.assert_reproduces(got, runs.outputs(reference, transformer_inputs()), untrained)


def test_comfyui_lora_keys_and_weights(ernie_run: Path) -> None:
    model_dir = ernie_run.parent.parent / "model"
    file = load_file(str(ernie_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in file}
    assert modules == {f"diffusion_model.layers.{i}.{m}" for i in range(2) for m in BLOCK_LINEARS}
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight", ".alpha")) for k in file)
    assert float(file["diffusion_model.layers.0.self_attention.to_q.alpha"]) == RANK  # the strength folded into B

    base = load_file(str(model_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    native = {f"diffusion_model.{k}": v for k, v in base.items()}
    key_map = comfy.generic_key_map(base)  # ComfyUI's ErnieImage branch adds transformer.<name> on top
    key_map.update(comfy.transformer_names_key_map(base))
    applied = comfy.apply_file(native, file, key_map)
    trained = runs.merge_peft(base, runs.checkpoint_params(ernie_run), ALPHA / RANK)
    comfy.assert_applies_as_trained({k.removeprefix("diffusion_model."): v for k, v in applied.items()}, trained, base)
