"""Ideogram 4 full fine-tunes: the shards a run saves export as a diffusers ``transformer`` folder and as one file in
Ideogram's original layout (fused ``attention.qkv``), and both load back to the fine-tuned weights; LoKr keys in the
ComfyUI format are Ideogram's names, and a LoKr on q, k or v (one fused weight in ComfyUI) is refused for it by name."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_ideogram.config import Ideogram4Config
from diffpipe_ideogram.plugin import plugin

CPU = torch.device("cpu")


def config(path: Path, **extra):
    return validate(Ideogram4Config, {"type": "ideogram4", "path": path, "dtype": "float32", **extra}, "test")


def test_full_model_exports_load_back(tiny_ideogram4: Path, tmp_path: Path) -> None:
    from diffusers import Ideogram4Transformer2DModel

    model = plugin.load_diffusion_model(model_config=config(tiny_ideogram4), device=CPU, dtype=torch.float32)
    with torch.no_grad():
        model.layers[1].attention.to_k.weight.add_(1.0)  # "fine-tuned"
        model.llm_cond_norm.weight.add_(1.0)
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(plugin, model, config(tiny_ideogram4), saved)
    single = saved / "single_file" / plugin.single_file_name
    assert load_file(str(single))["layers.1.attention.qkv.weight"].shape == (96, 32)  # Ideogram's fused layout
    from_single = plugin.load_diffusion_model(
        model_config=config(tiny_ideogram4, diffusion_model=single), device=CPU, dtype=torch.float32
    ).state_dict()
    from_folder = Ideogram4Transformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single[key], value) and torch.equal(from_folder[key], value), key


def test_lokr_names_in_comfyui_are_ideograms_and_a_fused_qkv_is_refused() -> None:
    import pytest

    stems = plugin.adapter_key_names(modules=["layers.0.feed_forward.w1", "layers.1.attention.to_out.0"],
                                     format="comfyui")
    assert stems == {"layers.0.feed_forward.w1": "diffusion_model.layers.0.feed_forward.w1",
                     "layers.1.attention.to_out.0": "diffusion_model.layers.1.attention.o"}
    with pytest.raises(ValueError, match=r"no ComfyUI counterpart of their own .*layers\.0\.attention\.to_q"):
        plugin.adapter_key_names(modules=["layers.0.attention.to_q"], format="comfyui")
