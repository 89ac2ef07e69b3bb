"""End to end through the real CLI (DeepSpeed on gloo, the real cache, peft), on the one shared run (conftest's
``lumina_run``): the loss falls; the saved files equal the golden manifest; the diffusers LoRA loads through
Lumina2Pipeline.load_lora_weights and reproduces the trained transformer; the ComfyUI file holds only native module
names ComfyUI's Lumina 2 key map accepts (``qkv`` fused), with alpha, and applies to original-layout weights like the
separate LoRAs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diffpipe_core.testing import lora_project, runs
from diffpipe_core.testing.golden import assert_matches
from diffpipe_lumina.original import layout_for_config
from diffpipe_lumina.testing import original_path, write_tiny_lumina2

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 16
MODEL = {"type": "lumina2", "text_max_length": 48}
GOLDEN = Path(__file__).parent / "golden"  # saved/final of the shared run (golden.py: bytes, or values on another CPU)


def run_config(model: dict = MODEL, **top: object) -> str:
    return lora_project.run_config(model, 3e-2, STEPS, RANK, ALPHA, **top)


def make_project(root: Path, tiny: Path | None = None) -> Path:
    """The tiny model (a copy of the session's ``tiny`` folder and its single file, when given), 4 captioned 32x32
    images and ``run.toml`` in ``root``."""
    write = write_tiny_lumina2 if tiny is None else lora_project.copy_of(tiny, original_path)
    return lora_project.make_project(root, write, run_config())


def transformer_inputs(seed: int = 0) -> dict:
    """Inputs of ``Lumina2Transformer2DModel.forward`` as the pipeline gives them: two captions of different lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2, 48, dtype=torch.long)
    mask[0, :30], mask[1, :41] = 1, 1
    return {
        "hidden_states": torch.randn(2, 4, 4, 4, generator=g),
        "timestep": torch.rand(2, generator=g),
        "encoder_hidden_states": torch.randn(2, 48, 32, generator=g),
        "encoder_attention_mask": mask,
    }


def test_loss_falls_and_the_saved_files_are_golden(lumina_run: Path) -> None:
    runs.assert_loss_falls(lumina_run, STEPS, window=4)
    assert runs.stage_files(lumina_run) == ["params-stage0.safetensors"]
    assert_matches(lumina_run / "saved" / "final", GOLDEN / "one_process.json")


def test_diffusers_lora_loads_in_lumina2_pipeline_and_reproduces(lumina_run: Path) -> None:
    from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel

    model_dir, saved = lumina_run.parent.parent / "model", lumina_run / "saved" / "final"
    holding = ("layers.1.attn.to_q.lora_B.weight", "context_refiner.0.feed_forward.linear_3.lora_A.weight",
               "noise_refiner.1.norm1.linear.lora_A.weight")
    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding)
    trained = ("layers.0.norm1.linear", "context_refiner.1.attn.to_v", "noise_refiner.0.feed_forward.linear_2")
    reference = runs.trained_transformer(Lumina2Transformer2DModel, lumina_run, model_dir, RANK, ALPHA,
                                         cfg["target_modules"], trained)
    pipe = Lumina2Pipeline.from_pretrained(str(model_dir), local_files_only=True)
    # alpha != rank, so reproducing the outputs also proves diffusers applied the trained strength
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(), ALPHA)


def test_comfyui_lora_keys_and_fused_weights(lumina_run: Path) -> None:
    model_dir = lumina_run.parent.parent / "model"
    native = load_file(str(original_path(model_dir)))  # ComfyUI's NextDiT uses these names
    table = layout_for_config(json.loads((model_dir / "transformer" / "config.json").read_text()))
    file, stems = lora_project.assert_comfyui_file_applies(lumina_run, native, table.to_model, RANK, ALPHA)
    blocks = ("layers.1.attention.qkv", "context_refiner.0.attention.qkv", "noise_refiner.1.adaLN_modulation.1",
              "layers.0.feed_forward.w3", "context_refiner.1.attention.out")
    assert {f"diffusion_model.{b}" for b in blocks} <= stems
    assert not any("context_refiner" in s and "adaLN" in s for s in stems)  # the context refiner is unmodulated
    assert float(file["diffusion_model.layers.0.attention.qkv.alpha"]) == 3 * RANK  # q, k, v fused
    assert float(file["diffusion_model.layers.0.feed_forward.w1.alpha"]) == RANK
    assert file["diffusion_model.layers.0.attention.qkv.lora_B.weight"].shape == (32 + 16 + 16, 3 * RANK)
