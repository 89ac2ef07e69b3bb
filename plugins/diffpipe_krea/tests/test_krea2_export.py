"""Krea 2 full fine-tunes: the shards a run saves export as a diffusers ``transformer`` folder and as one file in
Krea's original layout, and both load back to the fine-tuned weights; LoKr keys in the ComfyUI format are the
diffusers names under ``transformer.``, which ComfyUI's Krea 2 key map takes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_krea.config import Krea2Config
from diffpipe_krea.plugin import plugin

CPU = torch.device("cpu")


def config(path: Path, **extra):
    return validate(Krea2Config, {"type": "krea2", "path": path, "dtype": "float32", **extra}, "test")


def test_full_model_exports_load_back(tiny_krea2: Path, tmp_path: Path) -> None:
    from diffusers import Krea2Transformer2DModel

    model = plugin.load_diffusion_model(model_config=config(tiny_krea2), device=CPU, dtype=torch.float32)
    with torch.no_grad():
        model.transformer_blocks[1].scale_shift_table.add_(1.0)  # "fine-tuned"
        model.text_fusion.refiner_blocks[0].ff.up.weight.add_(1.0)
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(plugin, model, config(tiny_krea2), saved)
    single = saved / "single_file" / plugin.single_file_name
    assert load_file(str(single))["blocks.1.mod.lin"].dim() == 1  # Krea's layout: the table flattened
    from_single = plugin.load_diffusion_model(
        model_config=config(tiny_krea2, diffusion_model=single), device=CPU, dtype=torch.float32
    ).state_dict()
    from_folder = Krea2Transformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single[key], value) and torch.equal(from_folder[key], value), key


def test_lokr_names_in_comfyui_are_the_diffusers_names() -> None:
    modules = ["transformer_blocks.0.ff.gate", "text_fusion.layerwise_blocks.1.attn.to_out.0", "txt_in.linear_1"]
    stems = plugin.adapter_key_names(modules=modules, format="comfyui")
    assert stems == {m: f"transformer.{m}" for m in modules}
