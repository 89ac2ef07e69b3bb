"""Full fine-tunes: the shards a run saves export as a diffusers ``transformer`` folder and as one file in ComfyUI's
layout (``save_model_formats = ["diffusers", "single_file"]``), and both load back to the fine-tuned weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from test_qwenimage_model import config

from diffpipe_core.testing import runs
from diffpipe_qwenimage.plugin import plugin as qwen

CPU = torch.device("cpu")


def test_full_model_exports_load_back(tiny_qwen: Path, tmp_path: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    cfg = config(tiny_qwen)
    model = qwen.load_diffusion_model(model_config=cfg, device=CPU, dtype=torch.float32)
    with torch.no_grad():
        model.transformer_blocks[1].img_mlp.net[2].weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(qwen, model, cfg, saved)
    assert qwen.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / "x", format="ckpt") is None
    single = saved / "single_file" / qwen.single_file_name
    assert "transformer_blocks.1.img_mlp.net.2.weight" in load_file(str(single))
    from_single = qwen.load_diffusion_model(
        model_config=config(tiny_qwen, diffusion_model=single), device=CPU, dtype=torch.float32
    ).state_dict()
    from_folder = QwenImageTransformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single[key], value), key
        assert torch.equal(from_folder[key], value), key
