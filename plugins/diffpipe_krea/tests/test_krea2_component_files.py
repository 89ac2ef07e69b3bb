"""Krea 2 from the files ComfyUI users keep (issue 35): the transformer in Krea's original layout under
``model.diffusion_model.`` (``krea2_raw.safetensors``), Qwen-Image's VAE in the Wan VAE layout
(``qwen_image_vae.safetensors``), Qwen3-VL's language model alone under ``model.`` (the vision tower left out), beside
a folder of only configs and the tokenizer, loading exactly as the folder; ComfyUI's fp8 scaled and int8 transformers
kept quantized; configs from the Hugging Face cache's snapshot of the published repository."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core.component_files import cached_snapshot
from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_core.schema import validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    assert_variant_loads_as_itself,
    comfyui_files,
    files_config,
    hub_snapshot,
    quantize_file,
    variant_file,
    variant_model,
)
from diffpipe_krea.config import Krea2Config, Krea2TurboConfig
from diffpipe_krea.original import layout_for_config
from diffpipe_krea.plugin import plugin


def krea_files(folder: Path, out: Path, vision: bool = True) -> dict:
    """``folder`` as ComfyUI's Krea 2 files under ``out`` (and its configs at ``out/configs``); ``vision=False``: the
    text encoder file without the vision tower."""
    files = comfyui_files(folder, out, layout_for_config, wan_vae_table, {"text_encoder": "model."})
    if not vision:
        [te] = files["text_encoders"]
        save_file({k: v for k, v in load_file(str(te)).items() if ".visual." not in k}, str(te))
    return files


def from_files(files: dict, schema=Krea2Config, **keys):
    return files_config(schema, "krea2", files, "krea2", **keys)


def test_component_files_load_exactly_the_folders_weights(tiny_krea2: Path, tmp_path: Path) -> None:
    files = krea_files(tiny_krea2, tmp_path)
    assert "model.diffusion_model.blocks.0.attn.wq.weight" in load_file(str(files["diffusion_model"]))
    cfg = from_files(files)
    folder = validate(Krea2Config, {"type": "krea2", "path": tiny_krea2, "encoder_dtype": "float32"}, "test")
    assert_loads_as_the_folder(plugin, cfg, folder, ("vae", "text_encoder"))
    lines = "\n".join(plugin.model_file_lines(cfg))
    assert f"diffusion_model: {files['diffusion_model']}: Krea 2 (ComfyUI) layout" in lines
    assert "(Qwen3VLModel)" in lines and "(AutoencoderKLQwenImage)" in lines
    # a Qwen3-VL file of the language model alone (the vision tower is never run for text) loads it the same
    bare = from_files(krea_files(tiny_krea2, tmp_path / "bare", vision=False))
    assert plugin.validate_model_files(bare) == []
    got = plugin.load_encoders(bare, torch.device("cpu")).text_encoder.state_dict()
    want = load_file(str(tiny_krea2 / "text_encoder" / "model.safetensors"))
    language = [k for k in want if k.startswith("language_model.")]
    assert language and all(torch.equal(got[k], want[k]) for k in language)


@pytest.mark.parametrize(("form", "storage"), [("fp8_scaled", torch.float8_e4m3fn), ("int8_convrot", torch.int8)])
def test_a_quantized_transformer_stays_quantized(tiny_krea2: Path, tmp_path: Path, form: str, storage) -> None:
    files = krea_files(tiny_krea2, tmp_path)
    quantized = quantize_file(files["diffusion_model"], tmp_path / f"krea2_raw_{form}.safetensors", form)
    model = assert_kept_quantized(plugin, from_files(files, diffusion_model=quantized), from_files(files), storage)
    g = torch.Generator().manual_seed(0)  # the layers run on it: the compute dtype is not the stored weights'
    out = torch.randn(1, 4, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 3, 12, 32, generator=g)
    out = (*out, torch.ones(1, 3, dtype=torch.bool), torch.tensor([2, 2]))
    with torch.no_grad():
        for layer in plugin.split_into_layers(model, None):
            out = layer(out)
    assert out[0].shape == (1, 4, 16) and out[0].isfinite().all()


def test_configs_from_the_hugging_face_cache(tiny_krea2_turbo: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"no snapshot of krea/Krea-2-Turbo"):
        cached_snapshot(Krea2TurboConfig.hub_repos, "krea2-turbo")
    files = krea_files(tiny_krea2_turbo, tmp_path / "comfy")
    snapshot = hub_snapshot(tiny_krea2_turbo, tmp_path / "hub", "krea/Krea-2-Turbo")
    table = {"type": "krea2-turbo", "diffusion_model": files["diffusion_model"], "vae": files["vae"],
             "text_encoders": [{"path": files["text_encoders"][0], "type": "krea2"}]}
    cfg = validate(Krea2TurboConfig, table, "test")
    assert cfg.path == snapshot and plugin.validate_model_files(cfg) == []


def test_a_file_of_another_depth_is_read_as_such(tiny_krea2: Path, tmp_path: Path) -> None:
    """A Krea 2 file with more blocks than the folder's config says (another size of the model) is sized from its
    own tensors (``file_config``), named so by ``validate``, and loads as itself."""
    files = krea_files(tiny_krea2, tmp_path)
    read = {"num_layers": 3}
    variant = variant_model(plugin, files["configs"], **read)
    file = variant_file(plugin, variant, tmp_path / "krea2_deeper.safetensors")
    assert_variant_loads_as_itself(plugin, from_files(files, diffusion_model=file), variant, read)
