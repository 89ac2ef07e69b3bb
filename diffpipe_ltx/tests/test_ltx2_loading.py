"""LTX-2: the diffusers folder and the original single file load to the same weights (the file's connector tensors
ignored), the original layout agrees with diffusers' own converter, per-stage loading reads only each stage's
tensors from either layout, and bad input is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_ltx.config import LTX2Config
from diffpipe_ltx.ltx2 import ltx2 as plugin
from diffpipe_ltx.ltx2_original import diffusers_name
from diffpipe_ltx.ltx2_testing import single_file_path

CPU = torch.device("cpu")


def config(path: Path, **kw) -> LTX2Config:
    table = {"type": "ltx-2", "path": path, "dtype": "float32", "encoder_dtype": "float32",
             "max_sequence_length": 16, **kw}
    return validate(LTX2Config, table, "test")


def test_both_layouts_load_the_same_weights_as_diffusers_converts(tiny_ltx2: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    file = single_file_path(tiny_ltx2)
    folder = plugin.load_diffusion_model(model_config=config(tiny_ltx2), device=CPU, dtype=torch.float32)
    single = plugin.load_diffusion_model(model_config=config(tiny_ltx2, diffusion_model=file), device=CPU,
                                         dtype=torch.float32)
    a, b = folder.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and len(a) > 100
    assert all(torch.equal(a[k], b[k]) for k in a)
    original = load_file(str(file))
    for key in ("patchify_proj.weight", "audio_patchify_proj.weight", "audio_adaln_single.linear.weight",
                "av_ca_a2v_gate_adaln_single.linear.weight", "transformer_blocks.1.audio_to_video_attn.q_norm.weight",
                "transformer_blocks.0.scale_shift_table_a2v_ca_audio"):
        assert "model.diffusion_model." + key in original, key
    assert any(".video_embeddings_connector." in k for k in original)  # skipped on load
    # diffusers' own converter maps the file (without the connectors it drops) to the folder's keys
    transformer = {k: v for k, v in original.items() if k.startswith("model.diffusion_model.")}
    theirs = convert_ltx2_transformer_to_diffusers(transformer)
    assert theirs.keys() == a.keys() and all(torch.equal(theirs[k], a[k]) for k in a)
    assert diffusers_name("transformer_blocks.1.video_to_audio_attn.k_norm.weight") == (
        "transformer_blocks.1.video_to_audio_attn.norm_k.weight"
    )


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_tensors(tiny_ltx2: Path, layout: str) -> None:
    cfg = config(tiny_ltx2, diffusion_model=single_file_path(tiny_ltx2) if layout == "original" else None)
    registry = Registry()
    assert registry.register_model("ltx-2", plugin).ok
    stages = assert_stages_read_their_own(registry.model("ltx-2"), cfg, stages=2)
    read = {k for s in stages for k in s.reads}
    assert not any("embeddings_connector" in k or k.startswith("text_embedding") for k in read)


def test_validate_model_files(tiny_ltx2: Path, tmp_path: Path) -> None:
    assert plugin.validate_model_files(model_config=config(tiny_ltx2)) == []
    assert plugin.validate_model_files(
        model_config=config(tiny_ltx2, diffusion_model=single_file_path(tiny_ltx2))
    ) == []
    (found,) = plugin.validate_model_files(model_config=config(tiny_ltx2, max_sequence_length=12))
    assert "max_sequence_length 12" in found and "8 learnable registers" in found
    other = tmp_path / "other"
    shutil.copytree(tiny_ltx2, other, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "LTXPipeline"}))
    (found,) = plugin.validate_model_files(model_config=config(other))
    assert "'LTXPipeline'" in found and "'LTX2Pipeline'" in found
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "LTX2ImageToVideoPipeline"}))
    connectors = json.loads((other / "connectors" / "config.json").read_text())
    (other / "connectors" / "config.json").write_text(json.dumps({**connectors, "caption_channels": 64}))
    found = plugin.validate_model_files(model_config=config(other))
    assert any("connectors/config.json: caption_channels is 64" in p for p in found), found
    transformer = json.loads((other / "transformer" / "config.json").read_text())
    (other / "transformer" / "config.json").write_text(json.dumps({**transformer, "cross_attn_mod": True}))
    with pytest.raises(ValueError, match=r"transformer/config\.json.*LTX-2\.3"):
        plugin.load_diffusion_model(model_config=config(other), device=CPU, dtype=torch.float32)


def test_full_finetune_exports_load_back(tiny_ltx2: Path, tmp_path: Path) -> None:
    from diffusers import LTX2VideoTransformer3DModel

    from diffpipe_core.testing import runs

    cfg = config(tiny_ltx2)
    model = plugin.load_diffusion_model(model_config=cfg, device=CPU, dtype=torch.float32)
    with torch.no_grad():
        model.transformer_blocks[0].attn1.to_q.weight.add_(1.0)  # "fine-tuned"
        model.transformer_blocks[1].video_a2v_cross_attn_scale_shift_table.add_(1.0)
    state = runs.export_full_finetune(plugin, model, cfg, tmp_path / "saved")
    single = tmp_path / "saved" / "single_file" / "ltx2-transformer.safetensors"
    assert "model.diffusion_model.transformer_blocks.1.scale_shift_table_a2v_ca_video" in load_file(str(single))
    from_single = plugin.load_diffusion_model(model_config=config(tiny_ltx2, diffusion_model=single), device=CPU,
                                              dtype=torch.float32).state_dict()
    from_folder = LTX2VideoTransformer3DModel.from_pretrained(str(tmp_path / "saved" / "diffusers")).state_dict()
    assert all(torch.equal(from_single[k], v) and torch.equal(from_folder[k], v) for k, v in state.items())
