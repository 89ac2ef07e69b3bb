"""End to end through the real CLI (DeepSpeed on gloo, the real cache, peft), on the one shared run (conftest's
``omnigen_run``: 2 pipeline stages in 2 processes): the loss falls and each stage saved its share; the diffusers-style
LoRA (``transformer.<module>.lora_A.weight``) loads through the plugin's own transformer loader
(``OmniGen2Transformer2DModel.load_lora_adapter``, diffusers' ``PeftAdapterMixin``) and reproduces the trained
transformer; the ComfyUI file holds only keys ComfyUI's key map accepts for its Omnigen2 model, with alpha, and
applied as ComfyUI applies it equals the trained weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import lora_project, runs
from diffpipe_omnigen.testing import comfy_path

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 16
MODEL = {"type": "omnigen2", "text_max_length": 48}


def run_config(model: dict = MODEL, **top: object) -> str:
    return lora_project.run_config(model, 3e-2, STEPS, RANK, ALPHA, **{"pipeline_stages": 2,
                                                                       "micro_batch_size_per_gpu": 4, **top})


def make_project(root: Path, tiny: Path | None = None) -> Path:
    """The tiny model (a copy of the session's ``tiny`` folder and its ComfyUI-style file, when given), 4 captioned
    32x32 images and ``run.toml`` in ``root``."""
    from diffpipe_omnigen.testing import write_tiny_omnigen2

    write = write_tiny_omnigen2 if tiny is None else lora_project.copy_of(tiny, comfy_path)
    return lora_project.make_project(root, write, run_config())


def transformer_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2, 20, dtype=torch.long)
    mask[0, :12], mask[1, :20] = 1, 1
    return {"hidden_states": torch.randn(2, 4, 4, 4, generator=g), "timestep": torch.rand(2, generator=g),
            "text_hidden_states": torch.randn(2, 20, 32, generator=g), "text_attention_mask": mask,
            "return_dict": True}


def test_loss_falls_on_two_stages(omnigen_run: Path) -> None:
    runs.assert_trained_in_stages(omnigen_run, STEPS, 2)
    runs.assert_loss_falls(omnigen_run, STEPS, window=4)


def test_diffusers_lora_loads_in_the_transformer_and_reproduces(omnigen_run: Path) -> None:
    from diffpipe_omnigen.model import OmniGen2Transformer2DModel

    model_dir, saved = omnigen_run.parent.parent / "model", omnigen_run / "saved" / "final"
    holding = ("layers.1.norm1.linear.lora_B.weight", "context_refiner.0.attn.to_q.lora_A.weight",
               "noise_refiner.0.feed_forward.linear_3.lora_A.weight")
    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding)
    reference = runs.trained_transformer(OmniGen2Transformer2DModel, omnigen_run, model_dir, RANK, ALPHA,
                                         cfg["target_modules"], ("layers.0.attn.to_out.0",))
    model = OmniGen2Transformer2DModel.from_pretrained(str(model_dir / "transformer")).eval()
    untrained = runs.outputs(model, transformer_inputs())
    model.load_lora_adapter(str(saved), weight_name="adapter_model.safetensors", prefix="transformer",
                            adapter_name="trained")
    got = runs.outputs(model, transformer_inputs())
    runs.assert_reproduces(got, runs.outputs(reference, transformer_inputs()), untrained)


def test_comfyui_lora_keys_are_comfyuis_and_apply(omnigen_run: Path) -> None:
    native = load_file(str(omnigen_run.parent.parent / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))
    to_model = lambda applied: {k.removeprefix("diffusion_model."): v for k, v in applied.items()}  # noqa: E731
    file, stems = lora_project.assert_comfyui_file_applies(omnigen_run, native, to_model, RANK, ALPHA)
    assert "diffusion_model.layers.1.attn.to_q" in stems and "diffusion_model.context_refiner.0.attn.to_v" in stems
    # the trained alpha / rank is folded into lora_B, so the file's alpha is the rank (ComfyUI's scale alpha / rank = 1)
    assert float(file["diffusion_model.layers.0.attn.to_q.alpha"]) == RANK
