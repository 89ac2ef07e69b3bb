"""Qwen-Image 2.1 full fine-tunes: the shards a run saves export as a diffusers ``transformer`` folder and as one file
in ComfyUI's layout, and both load back to the fine-tuned weights; LoKr keys in the ComfyUI format are the diffusers
names under ``transformer.``, which ComfyUI's Qwen-Image key map takes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_qwenimage.config import QwenImage21Config
from diffpipe_qwenimage.qwen21 import plugin

CPU = torch.device("cpu")


def config(path: Path, **extra):
    return validate(QwenImage21Config, {"type": "qwen-image-2.1", "path": path, "dtype": "float32", **extra}, "test")


def test_full_model_exports_load_back(tiny_qwen21: Path, tmp_path: Path) -> None:
    from diffusers import QwenImage21Transformer2DModel

    model = plugin.load_diffusion_model(model_config=config(tiny_qwen21), device=CPU, dtype=torch.float32)
    with torch.no_grad():
        model.transformer_blocks[1].img_mlp.gate_layer.weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(plugin, model, config(tiny_qwen21), saved)
    single = saved / "single_file" / plugin.single_file_name
    assert "transformer_blocks.1.img_mlp.gate_layer.weight" in load_file(str(single))
    from_single = plugin.load_diffusion_model(
        model_config=config(tiny_qwen21, diffusion_model=single), device=CPU, dtype=torch.float32
    ).state_dict()
    from_folder = QwenImage21Transformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single[key], value) and torch.equal(from_folder[key], value), key


def test_lokr_names_in_comfyui_are_the_diffusers_names() -> None:
    modules = ["transformer_blocks.0.img_mlp.gate_layer", "transformer_blocks.1.attn.to_out.0"]
    stems = plugin.adapter_key_names(modules=modules, format="comfyui")
    assert stems == {m: f"transformer.{m}" for m in modules}
