"""Full fine-tunes: the shards a run saves export as a diffusers ``transformer`` folder and as one file in ComfyUI's
layout (``save_model_formats = ["diffusers", "single_file"]``), and both load back to the fine-tuned weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from test_qwenimage_model import config

from diffpipe_core.engine.saving import write_model_shards
from diffpipe_qwenimage.plugin import plugin as qwen

CPU = torch.device("cpu")


def test_full_model_exports_load_back(tiny_qwen: Path, tmp_path: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    cfg = config(tiny_qwen)
    model = qwen.load_diffusion_model(model_config=cfg, device=CPU, dtype=torch.float32)
    with torch.no_grad():
        model.transformer_blocks[1].img_mlp.net[2].weight.add_(1.0)  # "fine-tuned"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    saved = tmp_path / "saved"  # as the core saves a full fine-tune (shards + model.safetensors.index.json)
    kw = {"rank": 0, "stage_id": 0, "dp_rank": 0, "num_stages": 1, "dtype": torch.float32}
    write_model_shards(saved, state, barrier=lambda: None, **kw)
    for fmt in ("single_file", "diffusers"):
        assert qwen.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / fmt, format=fmt)
    assert qwen.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / "x", format="ckpt") is None
    single = saved / "single_file" / qwen.single_file_name
    assert "transformer_blocks.1.img_mlp.net.2.weight" in load_file(str(single))
    from_single = qwen.load_diffusion_model(
        model_config=config(tiny_qwen, transformer_file=single), device=CPU, dtype=torch.float32
    ).state_dict()
    from_folder = QwenImageTransformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single[key], value), key
        assert torch.equal(from_folder[key], value), key
