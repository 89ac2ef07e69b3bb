"""FLUX.3 from component files: the transformer in BFL's layout under ``model.diffusion_model.``
(``flux-3-image-klein-base.safetensors``) or in diffusers' names (ComfyUI has no FLUX.3 model yet), FLUX.2's VAE in
BFL's layout, Qwen3-VL in transformers' names, beside a folder of only configs and the processor, loading exactly as the
folder; fp8 scaled and int8 transformers kept quantized, their layers running; configs from the Hugging Face cache's
snapshot of the published repository."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.component_files import cached_snapshot
from diffpipe_core.parts.flux2_vae import vae_layout
from diffpipe_core.schema import validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    comfyui_files,
    component_state,
    files_config,
    hub_snapshot,
    quantize_file,
    save,
)
from diffpipe_flux.config import Flux3Config, Flux3DistilledConfig
from diffpipe_flux.flux3 import flux3
from diffpipe_flux.flux3_keys import layout_for_config


def from_files(files: dict, schema=Flux3Config, **keys):
    return files_config(schema, "flux3", files, **keys)


def test_component_files_load_exactly_the_folders_weights(tiny_flux3: Path, tmp_path: Path) -> None:
    files = comfyui_files(tiny_flux3, tmp_path, layout_for_config, vae_layout)
    folder = validate(Flux3Config, {"type": "flux3", "path": tiny_flux3, "encoder_dtype": "float32"}, "test")
    assert_loads_as_the_folder(flux3, from_files(files), folder, ("vae", "text_encoder"))
    lines = "\n".join(flux3.model_file_lines(from_files(files)))
    assert f"diffusion_model: {files['diffusion_model']}: BFL FLUX.3 layout" in lines, lines
    # a single file in diffusers' names (bare, or under ComfyUI's prefix) loads the same weights
    state = component_state(tiny_flux3, "transformer")
    for name, prefix in (("bare", ""), ("prefixed", "model.diffusion_model.")):
        file = save({prefix + k: v for k, v in state.items()}, tmp_path / f"{name}.safetensors")
        got = flux3.load_diffusion_model(from_files(files, diffusion_model=file), torch.device("cpu"), torch.float32)
        assert all(torch.equal(v, state[k]) for k, v in got.state_dict().items())


@pytest.mark.parametrize(("form", "storage"), [("fp8_scaled", torch.float8_e4m3fn), ("int8_convrot", torch.int8)])
def test_a_quantized_transformer_stays_quantized(tiny_flux3: Path, tmp_path: Path, form: str, storage) -> None:
    files = comfyui_files(tiny_flux3, tmp_path, layout_for_config, vae_layout)
    quantized = quantize_file(files["diffusion_model"], tmp_path / f"flux3_{form}.safetensors", form)
    model = assert_kept_quantized(flux3, from_files(files, diffusion_model=quantized), from_files(files), storage)
    g = torch.Generator().manual_seed(0)  # the layers run on it: the compute dtype is not the stored weights'
    out = (torch.randn(1, 4, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 3, 256, generator=g),
           torch.ones(1, 3, dtype=torch.bool), torch.tensor([2, 2]))
    with torch.no_grad():
        for layer in flux3.split_into_layers(model, None):
            out = layer(out)
    assert out[0].shape == (1, 4, 16) and out[0].isfinite().all()


def test_configs_from_the_hugging_face_cache(tiny_flux3_distilled: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"no snapshot of black-forest-labs/flux-3-image-klein"):
        cached_snapshot(Flux3DistilledConfig.hub_repos, "flux3-distilled")
    files = comfyui_files(tiny_flux3_distilled, tmp_path / "comfy", layout_for_config, vae_layout)
    snapshot = hub_snapshot(tiny_flux3_distilled, tmp_path / "hub", "black-forest-labs/flux-3-image-klein")
    table = {"type": "flux3-distilled", "diffusion_model": files["diffusion_model"], "vae": files["vae"],
             "text_encoders": files["text_encoders"]}
    cfg = validate(Flux3DistilledConfig, table, "test")
    assert cfg.path == snapshot and flux3.validate_model_files(cfg) == []
    assert flux3.flow_map(cfg)  # read from the file's ref_time_in (and the snapshot's config)
