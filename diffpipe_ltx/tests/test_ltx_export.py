"""Exports without training: the ComfyUI LoRA (native names, renames, ``.alpha``) applied to the original-layout
weights equals the diffusers LoRA merged; full fine-tunes written as a diffusers folder and an original single
file load back to the same weights."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.engine.saving import export_model_formats, write_model_shards
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.lightricks import diffusers_name, to_original
from diffpipe_ltx.plugin import plugin as ltx
from diffpipe_ltx.testing import TinyLTXConfig, tiny_transformer


def test_comfyui_lora_applies_like_the_diffusers_lora() -> None:
    model = tiny_transformer(TinyLTXConfig())
    targets = ltx.lora_targets(model_config=None) + ["proj_in", "time_embed.linear"]  # user-added: renamed modules
    runs.with_random_lora(model, targets)
    state = lora_state_dict(model)
    comfy = ltx.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    assert "diffusion_model.patchify_proj.lora_A.weight" in comfy
    assert "diffusion_model.adaln_single.linear.lora_B.weight" in comfy
    assert "diffusion_model.transformer_blocks.1.attn2.to_out.0.alpha" in comfy
    assert all(k.startswith("diffusion_model.") for k in comfy)
    assert float(comfy["diffusion_model.patchify_proj.alpha"]) == 6.0
    assert len(comfy) == 3 * len(state) // 2

    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    applied = runs.apply_comfyui(to_original(base), comfy)  # ComfyUI: W += alpha / rank * B @ A, original layout
    merged = runs.merge_peft(base, state, 6.0 / 4)
    runs.assert_state_close({diffusers_name(k): v for k, v in applied.items()}, merged)
    assert not torch.equal(merged["proj_in.weight"], base["proj_in.weight"])


def test_diffusers_format_and_unknown_format() -> None:
    state = {"transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 32)}
    out = ltx.export_adapter(state_dict=state, alpha=4.0, rank=4, format="diffusers")
    assert set(out) == {"transformer.transformer_blocks.0.attn1.to_q.lora_A.weight"}
    assert ltx.export_adapter(state_dict=state, alpha=4.0, rank=4, format="kohya") is None
    with pytest.raises(ValueError, match="lora_magnitude"):
        ltx.export_adapter(state_dict={"x.lora_magnitude_vector": torch.zeros(2)}, alpha=4.0, rank=4, format="comfyui")


def test_full_model_exports_load_back(tiny_ltx: Path, tmp_path: Path) -> None:
    table = {"type": "ltx-video", "path": tiny_ltx, "dtype": "float32"}
    cfg = validate(LTXConfig, table, "test")
    model = ltx.load_diffusion_model(model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        model.transformer_blocks[0].attn1.to_q.weight.add_(1.0)  # "fine-tuned"
        model.scale_shift_table.add_(1.0)
    # the core's own writer, as two pipeline stages (threads standing in for the two ranks) each saving half
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    halves = ({k: state[k] for k in keys[: len(keys) // 2]}, {k: state[k] for k in keys[len(keys) // 2 :]})
    saved, barrier = tmp_path / "saved", threading.Barrier(2)
    kw = {"num_stages": 2, "dtype": torch.float32, "barrier": barrier.wait, "dp_rank": 0}
    ranks = [
        threading.Thread(target=write_model_shards, args=(saved, halves[r]), kwargs={**kw, "rank": r, "stage_id": r})
        for r in (0, 1)
    ]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=60)
    assert len(json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]) == len(state)

    registry = Registry()
    assert registry.register_model("ltx-video", ltx).ok
    plugin = registry.model("ltx-video")
    assert export_model_formats(saved, plugin, cfg, ["single_file", "diffusers"]) == []
    assert ltx.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / "x", format="ckpt") is None
    single = saved / "single_file" / "ltxv-transformer.safetensors"
    assert "model.diffusion_model.patchify_proj.weight" in load_file(str(single))
    from_single = ltx.load_diffusion_model(
        model_config=validate(LTXConfig, {**table, "diffusion_model": single}, "test"),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    from diffusers import LTXVideoTransformer3DModel

    from_folder = LTXVideoTransformer3DModel.from_pretrained(str(saved / "diffusers"))
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder.state_dict()[key], value), key
