"""End to end through the real CLI (DeepSpeed on gloo, the real cache, peft), on the one shared run (conftest's
``sd3_run``): the loss falls; the saved diffusers LoRA loads through StableDiffusion3Pipeline.load_lora_weights and
reproduces the trained transformer; the ComfyUI file holds exactly the native module names ComfyUI's MMDiT key map
accepts, with alpha, and applies to Stability-layout weights like the separate LoRAs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diffpipe_core.testing import lora_project, runs
from diffpipe_sd3.original import layout_for_config
from diffpipe_sd3.testing import PREFIX, original_path, write_tiny_sd3

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 16
MODEL = {"type": "sd3", "text_max_length": 16, "shift": 1.0}


def run_config(model: dict = MODEL, **top: object) -> str:
    """The project's run config: 1 process, micro-batches of 4, ``STEPS`` steps; ``top`` changes the top-level keys."""
    return lora_project.run_config(model, 1e-2, STEPS, RANK, ALPHA, **top)


def make_project(root: Path, tiny: Path | None = None) -> Path:
    """The tiny model (a copy of the session's ``tiny`` folder and its single file, when given), 4 captioned 32x32
    images and ``run.toml`` in ``root``."""
    write = write_tiny_sd3 if tiny is None else lora_project.copy_of(tiny, original_path)
    return lora_project.make_project(root, write, run_config())


def transformer_inputs(seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(2, 4, 4, 4, generator=g),
        "timestep": torch.rand(2, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(2, 93, 64, generator=g),
        "pooled_projections": torch.randn(2, 48, generator=g),
    }


def test_loss_falls(sd3_run: Path) -> None:
    runs.assert_loss_falls(sd3_run, STEPS, window=4)
    assert runs.stage_files(sd3_run) == ["params-stage0.safetensors"]


def test_diffusers_lora_loads_in_sd3_pipeline_and_reproduces(sd3_run: Path) -> None:
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    model_dir, saved = sd3_run.parent.parent / "model", sd3_run / "saved" / "final"
    holding = ("transformer_blocks.0.attn2.to_q.lora_B.weight", "transformer_blocks.1.ff.net.2.lora_A.weight",
               "transformer_blocks.0.attn.add_q_proj.lora_A.weight")
    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding)
    trained = ("transformer_blocks.0.ff_context.net.2", "transformer_blocks.1.attn.add_k_proj")
    reference = runs.trained_transformer(SD3Transformer2DModel, sd3_run, model_dir, RANK, ALPHA, cfg["target_modules"],
                                         trained)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(model_dir), local_files_only=True)
    # alpha != rank, so reproducing the outputs also proves diffusers applied the trained strength
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(), ALPHA)


def test_comfyui_lora_keys_and_fused_weights(sd3_run: Path) -> None:
    model_dir = sd3_run.parent.parent / "model"
    native = {k.removeprefix(PREFIX): v for k, v in load_file(str(original_path(model_dir))).items()}
    table = layout_for_config(json.loads((model_dir / "transformer" / "config.json").read_text()))
    # ComfyUI's model_lora_keys_unet on its MMDiT (Stability's names)
    file, stems = lora_project.assert_comfyui_file_applies(sd3_run, native, table.to_model, RANK, ALPHA)
    blocks = ("0.x_block.attn.qkv", "0.x_block.attn2.qkv", "1.context_block.attn.qkv", "0.context_block.mlp.fc2",
              "1.x_block.mlp.fc1")
    assert {f"diffusion_model.joint_blocks.{b}" for b in blocks} <= stems
    assert float(file["diffusion_model.joint_blocks.0.x_block.attn.qkv.alpha"]) == 3 * RANK
    assert float(file["diffusion_model.joint_blocks.1.context_block.attn.qkv.alpha"]) == 2 * RANK  # no last-block q
    assert file["diffusion_model.joint_blocks.0.x_block.attn.qkv.lora_B.weight"].shape == (96, 3 * RANK)
