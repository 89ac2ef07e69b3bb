"""Issue point 1: both on-disk layouts load to the same weights, and per-stage loading reads only the rank's own
tensors (from either layout). Also: the original key layout against diffusers' own converter, and bad input
(files, keys, folders) reported by name, by loading and by ``validate_model_files``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core.engine import model_loading
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import counting
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.lightricks import original_name
from diffpipe_ltx.plugin import plugin as ltx
from diffpipe_ltx.testing import single_file_path


def config(path: Path, **kw) -> LTXConfig:
    table = {"type": "ltx-video", "path": path, "dtype": "float32", "encoder_dtype": "float32", **kw}
    return validate(LTXConfig, table, "test")


def test_both_layouts_load_the_same_weights(tiny_ltx: Path) -> None:
    folder = ltx.load_diffusion_model(model_config=config(tiny_ltx), device=torch.device("cpu"), dtype=torch.float32)
    single = ltx.load_diffusion_model(
        model_config=config(tiny_ltx, diffusion_model=single_file_path(tiny_ltx)),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    a, b = folder.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and len(a) > 40
    for key in a:
        assert torch.equal(a[key], b[key]), key
    keys = set(load_file(str(single_file_path(tiny_ltx))))  # really the original layout
    assert "model.diffusion_model.patchify_proj.weight" in keys
    assert "model.diffusion_model.adaln_single.linear.weight" in keys
    assert "model.diffusion_model.transformer_blocks.0.attn1.q_norm.weight" in keys
    assert not any("proj_in" in k or "time_embed" in k or "norm_q" in k for k in keys)


def test_original_layout_matches_diffusers_converter(tiny_ltx: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers

    original = load_file(str(single_file_path(tiny_ltx)))
    ours = load_file(str(tiny_ltx / "transformer" / "diffusion_pytorch_model.safetensors"))
    theirs = convert_ltx_transformer_checkpoint_to_diffusers(dict(original))
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_tensors(
    tiny_ltx: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tiny_ltx, diffusion_model=single_file_path(tiny_ltx) if layout == "original" else None)
    registry = Registry()
    assert registry.register_model("ltx-video", ltx).ok
    plugin = registry.model("ltx-video")
    read: list[str] = []
    monkeypatch.setattr(model_loading, "open_weights", counting(read))
    stage = model_loading.load_for_stages(plugin, cfg, torch.device("cpu"), torch.bfloat16)
    assert all(p.device.type == "meta" for p in stage.model.parameters())
    last_stage = range(2, len(stage.layers))  # block 1 + output layer: the second of 2 stages
    model_loading.materialise_layers(plugin, cfg, stage, last_stage, torch.device("cpu"))

    own = {n for n, p in stage.model.named_parameters() if p.device.type != "meta"}
    expected = {n for n, _ in stage.model.named_parameters() if n.startswith(("transformer_blocks.1.", "norm_out"))}
    expected |= {n for n, _ in stage.model.named_parameters() if n.startswith(("proj_out", "scale_shift_table"))}
    assert own == expected
    in_file = {"model.diffusion_model." + original_name(n) for n in expected} if layout == "original" else expected
    assert sorted(read) == sorted(in_file)  # nothing else was read from the file
    full = ltx.load_diffusion_model(model_config=cfg, device=torch.device("cpu"), dtype=torch.bfloat16).state_dict()
    for name, p in stage.model.named_parameters():
        if name in own:
            assert p.dtype == torch.bfloat16 and torch.equal(p, full[name]), name
    # the output layer holds the model's top-level scale_shift_table, filled in place
    assert stage.layers[-1].scale_shift_table is stage.model.scale_shift_table
    assert stage.layers[-1].scale_shift_table.device.type == "cpu"


def test_bad_single_file_names_file_and_key(tiny_ltx: Path, tmp_path: Path) -> None:
    bad = load_file(str(single_file_path(tiny_ltx)))
    bad["model.diffusion_model.transformer_blocks.0.extra.weight"] = torch.zeros(2)
    file = tmp_path / "bad.safetensors"
    save_file(bad, str(file))
    cpu = torch.device("cpu")
    with pytest.raises(KeyError, match=r"bad\.safetensors.*unexpected.*transformer_blocks\.0\.extra\.weight"):
        ltx.load_diffusion_model(model_config=config(tiny_ltx, diffusion_model=file), device=cpu, dtype=torch.float32)
    del bad["model.diffusion_model.transformer_blocks.0.extra.weight"]
    bad["model.diffusion_model.patchify_proj.bias"] = torch.zeros(3)
    save_file(bad, str(file))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*'model\.diffusion_model\.patchify_proj\.bias'.*\(3,\)"):
        ltx.load_diffusion_model(model_config=config(tiny_ltx, diffusion_model=file), device=cpu, dtype=torch.float32)


def test_validate_model_files(tiny_ltx: Path, tmp_path: Path) -> None:
    assert ltx.validate_model_files(model_config=config(tiny_ltx)) == []
    assert ltx.validate_model_files(model_config=config(tiny_ltx, diffusion_model=single_file_path(tiny_ltx))) == []

    # a diffusers-layout file given as diffusion_model is read by its own names (issue 35)
    diffusers_file = tiny_ltx / "transformer" / "diffusion_pytorch_model.safetensors"
    assert ltx.validate_model_files(model_config=config(tiny_ltx, diffusion_model=diffusers_file)) == []
    assert ": diffusers, float32" in ltx.model_file_lines(config(tiny_ltx, diffusion_model=diffusers_file))[0]

    # another model's folder, and components of different sizes
    other = tmp_path / "other"
    shutil.copytree(tiny_ltx, other, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    (found,) = ltx.validate_model_files(model_config=config(other))
    assert "model_index.json" in found and "'FluxPipeline'" in found and "'LTXPipeline'" in found
    (other / "model_index.json").write_text(json.dumps(index))
    t5 = json.loads((other / "text_encoder" / "config.json").read_text())
    (other / "text_encoder" / "config.json").write_text(json.dumps({**t5, "d_model": 64}))
    found = ltx.validate_model_files(model_config=config(other))
    assert any("text_encoder/config.json: d_model is 64" in p and "caption_channels 32" in p for p in found), found
    assert any("no diffusion_pytorch_model.safetensors" in p for p in found), found


def test_missing_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    cpu = torch.device("cpu")
    with pytest.raises(FileNotFoundError, match=r"empty/transformer/config\.json"):
        ltx.load_diffusion_model(model_config=config(tmp_path / "empty"), device=cpu, dtype=torch.float32)
    with pytest.raises(FileNotFoundError, match=r"empty/vae"):
        ltx.load_encoders(model_config=config(tmp_path / "empty"), device=cpu)
    (found,) = ltx.validate_model_files(model_config=config(tmp_path / "empty"))
    assert "empty/model_index.json: not found" in found
