"""LTX-Video from the files ComfyUI users keep (issue 35): the single checkpoint (``ltx-video-2b-v0.9.5.safetensors``:
the transformer under ``model.diffusion_model.`` and the VAE under ``vae.``, both in the original Lightricks layout)
given as ``diffusion_model`` and ``vae``, and ComfyUI's ``t5xxl_fp16.safetensors`` as the text encoder, beside a
folder of only configs and tokenizers (or the Hugging Face cache's snapshot of them); an fp8 scaled transformer kept
quantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.quantize import ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.testing.component_files import (
    assert_variant_loads_as_itself,
    component_state,
    config_only,
    dequantized_state,
    hub_snapshot,
    quantize_file,
    save,
    variant_file,
    variant_model,
)
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.lightricks import layout_for_config
from diffpipe_ltx.lightricks_vae import vae_table
from diffpipe_ltx.plugin import plugin as ltx

CPU = torch.device("cpu")


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI's LTX-Video files under ``out``: the checkpoint (transformer and VAE, each in the original
    layout under its prefix, with the latent statistics the model does not use), the T5 file, and a config-only
    folder."""
    config = json.loads((folder / "transformer" / "config.json").read_text())
    vae_config = json.loads((folder / "vae" / "config.json").read_text())
    state = layout_for_config(config).to_original(component_state(folder, "transformer"))
    state.update(vae_table(vae_config).to_original(component_state(folder, "vae")))
    channels = vae_config["latent_channels"]
    state["vae.per_channel_statistics.channel"] = torch.arange(channels, dtype=torch.float32)
    state["vae.per_channel_statistics.mean-of-stds"] = torch.ones(channels)
    return {
        "checkpoint": save(state, out / "ltx-video-2b-v0.9.5.safetensors"),
        "t5": save(component_state(folder, "text_encoder"), out / "t5xxl_fp16.safetensors"),
        "configs": config_only(folder, out / "configs"),
    }


@pytest.fixture(scope="module")
def comfy(tiny_ltx: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_ltx, tmp_path_factory.mktemp("comfy"))


def from_files(comfy: dict, **keys) -> LTXConfig:
    given = {"diffusion_model": comfy["checkpoint"], "vae": comfy["checkpoint"], "text_encoders": (comfy["t5"],)}
    return LTXConfig(type="ltx-video", path=comfy["configs"], **{**given, **keys})


def same_state(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_the_checkpoint_and_t5_file_load_exactly_the_folders_weights(tiny_ltx: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    assert ltx.validate_model_files(cfg) == []
    lines = ltx.model_file_lines(cfg)
    assert lines[0].startswith(f"diffusion_model: {comfy['checkpoint']}: original Lightricks layout, float32")
    assert f"vae: {comfy['checkpoint']}: original Lightricks layout" in "\n".join(lines)
    assert f"text_encoder: {comfy['t5']}: diffusers, float32" in "\n".join(lines)
    folder = LTXConfig(type="ltx-video", path=tiny_ltx, encoder_dtype="bfloat16")
    got, expected = ltx.load_encoders(cfg, CPU), ltx.load_encoders(folder, CPU)
    for name in ("vae", "text_encoder"):
        same_state(getattr(got, name), getattr(expected, name))
    same_state(
        ltx.load_diffusion_model(cfg, CPU, torch.bfloat16), ltx.load_diffusion_model(folder, CPU, torch.bfloat16)
    )


def test_a_vae_file_of_its_own_loads_too(tiny_ltx: Path, comfy: dict, tmp_path: Path) -> None:
    """A VAE file without the checkpoint's ``vae.`` prefix (a VAE saved alone) reads the same."""
    state = {k.removeprefix("vae."): v for k, v in load_file(str(comfy["checkpoint"])).items() if k.startswith("vae.")}
    cfg = from_files(comfy, vae=save(state, tmp_path / "ltxv_vae.safetensors"), encoder_dtype="float32")
    assert ltx.validate_model_files(cfg) == []
    folder = LTXConfig(type="ltx-video", path=tiny_ltx, encoder_dtype="float32")
    same_state(ltx.load_encoders(cfg, CPU).vae, ltx.load_encoders(folder, CPU).vae)


def test_the_vae_table_is_diffusers_converter_inverted_for_the_released_vaes() -> None:
    """The table built from the released VAEs' configs (0.9.0; 0.9.5 with its timestep conditioning) names every
    tensor as the original files do: diffusers' own converter maps the names back exactly."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLLTXVideo
    from diffusers.loaders.single_file_utils import convert_ltx_vae_checkpoint_to_diffusers

    v095 = {
        "block_out_channels": (128, 256, 512, 1024, 2048), "down_block_types": ("LTXVideo095DownBlock3D",) * 4,
        "decoder_block_out_channels": (256, 512, 1024), "layers_per_block": (4, 6, 6, 2, 2),
        "decoder_layers_per_block": (5, 5, 5, 5), "spatio_temporal_scaling": (True,) * 4,
        "decoder_spatio_temporal_scaling": (True,) * 3, "decoder_inject_noise": (False,) * 4,
        "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        "upsample_residual": (True,) * 3, "upsample_factor": (2,) * 3, "timestep_conditioning": True,
    }  # fmt: skip
    for config in ({}, v095):
        with init_empty_weights():
            model = AutoencoderKLLTXVideo.from_config(config)
        state = model.state_dict()  # meta tensors: only names and shapes matter
        original = vae_table(dict(model.config)).to_original(state)
        assert all(k.startswith("vae.") for k in original)
        assert set(convert_ltx_vae_checkpoint_to_diffusers(dict(original))) == set(state)


def test_an_fp8_scaled_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["checkpoint"], tmp_path / "ltxv-2b-0.9.5_fp8_e4m3fn_scaled.safetensors", "fp8_scaled")
    cfg = from_files(comfy, diffusion_model=file)
    assert ltx.validate_model_files(cfg) == []
    stored = [k for k, v in load_file(str(file)).items() if k.startswith("model.") and v.dtype == torch.float8_e4m3fn]
    model = ltx.load_diffusion_model(cfg, CPU, torch.bfloat16)
    kept = [m for m in model.modules() if isinstance(m, ScaledLinear)]
    assert len(kept) == len(stored) > 20 and all(m.weight.dtype == torch.float8_e4m3fn for m in kept)
    assert f"{len(kept)} linears kept quantized" in ltx.model_file_lines(cfg)[0]
    plain = LTXConfig(**{**dict(cfg), "diffusion_model": save(dequantized_state(file), tmp_path / "plain.st")})
    reference = dict(ltx.load_diffusion_model(plain, CPU, torch.float32).named_modules())
    for name, module in model.named_modules():
        if isinstance(module, ScaledLinear):  # stored * scale is exactly what the file stands for
            weight = module.weight.float() * module.weight_scale.float()
            assert torch.equal(weight, reference[name].weight), name
    registry = Registry()
    assert registry.register_model("ltx-video", ltx).ok
    assert_stages_read_their_own(registry.model("ltx-video"), cfg)


def test_configs_from_the_hugging_face_cache(tiny_ltx: Path, comfy: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    given = {"diffusion_model": comfy["checkpoint"], "vae": comfy["checkpoint"], "text_encoders": (comfy["t5"],)}
    with pytest.raises(ValueError, match=r"no snapshot of Lightricks/LTX-Video .*hf download"):
        LTXConfig(type="ltx-video", **given)
    snapshot = hub_snapshot(tiny_ltx, tmp_path / "hub", "Lightricks/LTX-Video")
    cfg = LTXConfig(type="ltx-video", **given)
    assert cfg.path == snapshot and ltx.validate_model_files(cfg) == []


def test_a_file_of_another_variant_loads_as_itself(comfy: dict, tmp_path: Path) -> None:
    """Another block count and width (as 13B beside a 2B folder: the same heads, wider) than the folder's config: read
    from the file's tensors."""
    read = {"num_layers": 1, "attention_head_dim": 24, "cross_attention_dim": 48}
    variant = variant_model(ltx, comfy["configs"], **read)
    file = variant_file(ltx, variant, tmp_path / "ltxv.safetensors")
    assert_variant_loads_as_itself(ltx, from_files(comfy, diffusion_model=file), variant, read)
