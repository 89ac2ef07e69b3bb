"""Ideogram 4 from the files ComfyUI users keep (Comfy-Org/Ideogram-4): the conditional transformer in Ideogram's
original layout under ``model.diffusion_model.`` (``ideogram4_fp8_scaled.safetensors``), FLUX.2's VAE in BFL's layout
(``flux2-vae.safetensors``), Qwen3-VL's language model under ``model.`` (the vision tower left out), beside a folder of
only configs and the tokenizer, loading exactly as the folder; ComfyUI's fp8 scaled and int8 transformers kept
quantized, the layers running on them; configs from the Hugging Face cache's snapshot of the published repository,
with a text encoder file that lacks the vision tower."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core.component_files import cached_snapshot
from diffpipe_core.parts.flux2_vae import vae_layout
from diffpipe_core.schema import validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    comfyui_files,
    files_config,
    hub_snapshot,
    quantize_file,
)
from diffpipe_ideogram.config import Ideogram4Config
from diffpipe_ideogram.original import layout_for_config
from diffpipe_ideogram.plugin import plugin


def ideogram_files(folder: Path, out: Path, vision: bool = True) -> dict:
    """``folder`` as ComfyUI's Ideogram 4 files under ``out`` (configs at ``out/configs``); ``vision=False``: the text
    encoder file without the vision tower."""
    files = comfyui_files(folder, out, layout_for_config, vae_layout, {"text_encoder": "model."})
    if not vision:
        [te] = files["text_encoders"]
        save_file({k: v for k, v in load_file(str(te)).items() if ".visual." not in k}, str(te))
    return files


@pytest.fixture(scope="module")
def files(tiny_ideogram4: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny folder as ComfyUI's files, written once for this module."""
    return ideogram_files(tiny_ideogram4, tmp_path_factory.mktemp("ideogram4-comfy"))


def from_files(files: dict, **keys):
    return files_config(Ideogram4Config, "ideogram4", files, "ideogram4", **keys)


def test_component_files_load_exactly_the_folders_weights(tiny_ideogram4: Path, files: dict) -> None:
    assert "model.diffusion_model.layers.0.attention.qkv.weight" in load_file(str(files["diffusion_model"]))
    assert "decoder.post_quant_conv.weight" in load_file(str(files["vae"]))
    cfg = from_files(files)
    assert plugin.validate_model_files(cfg) == []
    folder = validate(Ideogram4Config, {"type": "ideogram4", "path": tiny_ideogram4, "encoder_dtype": "float32"},
                      "test")
    assert_loads_as_the_folder(plugin, cfg, folder, ("vae", "text_encoder"))
    lines = "\n".join(plugin.model_file_lines(cfg))
    assert f"diffusion_model: {files['diffusion_model']}: Ideogram 4 (ComfyUI) layout" in lines
    assert "(Qwen3VLModel)" in lines and "(AutoencoderKLFlux2)" in lines


@pytest.mark.parametrize(("form", "storage"), [("fp8_scaled", torch.float8_e4m3fn), ("int8_convrot", torch.int8)])
def test_a_quantized_transformer_stays_quantized(files: dict, tmp_path: Path, form: str, storage) -> None:
    quantized = quantize_file(files["diffusion_model"], tmp_path / f"ideogram4_{form}.safetensors", form)
    model = assert_kept_quantized(plugin, from_files(files, diffusion_model=quantized), from_files(files), storage)
    g = torch.Generator().manual_seed(0)  # the layers run on it: the compute dtype is not the stored weights'
    out = torch.randn(1, 4, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 3, 13 * 32, generator=g)
    out = (*out, torch.ones(1, 3, dtype=torch.bool), torch.tensor([2, 2]))
    with torch.no_grad():
        for layer in plugin.split_into_layers(model, None):
            out = layer(out)
    assert out[0].shape == (1, 4, 16) and out[0].isfinite().all()


def test_configs_from_the_hugging_face_cache(tiny_ideogram4: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"no snapshot of ideogram-ai/ideogram-v4"):
        cached_snapshot(Ideogram4Config.hub_repos, "ideogram4")
    files = ideogram_files(tiny_ideogram4, tmp_path / "comfy", vision=False)
    snapshot = hub_snapshot(tiny_ideogram4, tmp_path / "hub", "ideogram-ai/ideogram-v4")
    table = {"type": "ideogram4", "diffusion_model": files["diffusion_model"], "vae": files["vae"],
             "text_encoders": [{"path": files["text_encoders"][0], "type": "ideogram4"}], "encoder_dtype": "float32"}
    cfg = validate(Ideogram4Config, table, "test")
    assert cfg.path == snapshot and plugin.validate_model_files(cfg) == []
    # a Qwen3-VL file of the language model alone (the vision tower is never run for text) loads it the same
    got = plugin.load_encoders(cfg, torch.device("cpu")).text_encoder.state_dict()
    want = load_file(str(tiny_ideogram4 / "text_encoder" / "model.safetensors"))
    language = [k for k in want if k.startswith("language_model.")]
    assert language and all(torch.equal(got[k], want[k]) for k in language)
