"""Cosmos-Predict2 from the files ComfyUI users keep (issue 35): the transformer in NVIDIA's layout under ``net.``
(``cosmos_predict2_2B_t2i.safetensors``, training-only tensors included), the Wan VAE in its original layout
(``wan_2.1_vae.safetensors``), the T5 v1.0 XXL in transformers' names (``oldt5_xxl_fp16.safetensors``, also fp8
scaled), beside a folder of only configs and the tokenizer; ComfyUI's fp8 scaled transformer kept quantized, each
stage reading its own tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_core.schema import validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_variant_loads_as_itself,
    config_only,
    dequantized_state,
    quantize_file,
    save,
    variant_file,
    variant_model,
    write_component_files,
)
from diffpipe_cosmos.plugin import predict2
from diffpipe_cosmos.testing import original_path

CPU = torch.device("cpu")


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI's Cosmos-Predict2 files (the transformer: the NVIDIA-layout file beside the folder) and a
    config-only folder ``out/configs``."""
    vae = json.loads((folder / "vae" / "config.json").read_text())
    files = write_component_files(folder, out, vae_table=wan_vae_table(vae))
    files["diffusion_model"] = original_path(folder)
    files["configs"] = config_only(folder, out / "configs")
    return files


@pytest.fixture(scope="module")
def comfy(tiny_predict2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_predict2, tmp_path_factory.mktemp("comfy"))


def from_files(files: dict, **keys):
    table = {"type": "cosmos-predict2", "path": files["configs"], "diffusion_model": files["diffusion_model"]}
    table.update(vae=files["vae"], text_encoders=[{"path": files["text_encoders"][0], "type": "cosmos"}])
    return validate(predict2.spec.config_schema, {**table, "encoder_dtype": "float32", **keys}, "test")


def same_state(got: nn.Module, expected: nn.Module) -> None:
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_component_files_load_exactly_the_folders_weights(tiny_predict2: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    assert predict2.validate_model_files(cfg) == []
    lines = "\n".join(predict2.model_file_lines(cfg))
    assert f"diffusion_model: {comfy['diffusion_model']}: NVIDIA Cosmos predict2 layout" in lines
    assert f"vae: {comfy['vae']}: original Wan VAE layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers" in lines and "(T5EncoderModel)" in lines
    assert "net.blocks.0.self_attn.q_proj.weight" in load_file(str(comfy["diffusion_model"]))
    folder = validate(predict2.spec.config_schema, {"type": "cosmos-predict2", "path": tiny_predict2}, "test")
    got = predict2.load_encoders(cfg, CPU)
    expected = predict2.load_encoders(folder.model_copy(update={"encoder_dtype": "float32"}), CPU)
    for name in ("vae", "text_encoder"):
        same_state(getattr(got, name), getattr(expected, name))
    same_state(
        predict2.load_diffusion_model(cfg, CPU, torch.bfloat16),
        predict2.load_diffusion_model(folder, CPU, torch.bfloat16),
    )


def test_a_checkpoint_comfyui_saved_loads_too(comfy: dict, tmp_path: Path) -> None:
    """ComfyUI holds the network without NVIDIA's ``net.``; a model it saves is under ``model.diffusion_model.``."""
    state = load_file(str(comfy["diffusion_model"]))
    saved = save({f"model.diffusion_model.{k.removeprefix('net.')}": v for k, v in state.items()}, tmp_path / "m.st")
    cfg = from_files(comfy, diffusion_model=saved)
    assert predict2.validate_model_files(cfg) == []
    same_state(
        predict2.load_diffusion_model(cfg, CPU, torch.float32),
        predict2.load_diffusion_model(from_files(comfy), CPU, torch.float32),
    )


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "cosmos_predict2_2B_t2i_fp8_scaled.st", "fp8_scaled")
    cfg = from_files(comfy, diffusion_model=file)
    assert_kept_quantized(predict2, cfg, from_files(comfy), torch.float8_e4m3fn)


def test_an_fp8_scaled_oldt5_loads_dequantized(comfy: dict, tmp_path: Path) -> None:
    t5 = quantize_file(comfy["text_encoders"][0], tmp_path / "oldt5_xxl_fp8_e4m3fn_scaled.safetensors", "fp8_scaled")
    encoder = predict2.load_encoders(from_files(comfy, text_encoders=[t5]), CPU).text_encoder
    values = dequantized_state(t5)
    state = encoder.state_dict()
    assert set(values) <= set(state)
    for name, tensor in values.items():
        assert torch.equal(state[name], tensor), name


def test_a_file_of_another_variant_loads_as_itself(comfy: dict, tmp_path: Path) -> None:
    """Another block count and heads (as 14B beside a 2B folder) than the folder's config: read from the file."""
    read = {"num_layers": 1, "num_attention_heads": 3}
    variant = variant_model(predict2, comfy["configs"], **read)
    file = variant_file(predict2, variant, tmp_path / "cosmos.safetensors")
    assert_variant_loads_as_itself(predict2, from_files(comfy, diffusion_model=file), variant, read)


@pytest.mark.slow
def test_component_files_train_as_the_folder(predict2_run: Path, tmp_path: Path) -> None:
    """The shared Cosmos-Predict2 run (2 stages in 2 processes from NVIDIA's transformer file and the folder), again
    from ComfyUI's files only (the transformer file, the Wan VAE file, the T5 file) beside a config-only folder:
    equal losses and LoRA files."""
    from test_cosmos_train import SAMPLE_TABLE, make_project

    from diffpipe_core.testing.component_files import assert_trains_as, train_from_files

    config = make_project(tmp_path, "cosmos-predict2", 2, True, SAMPLE_TABLE)
    files = comfy_files(tmp_path / "model", tmp_path / "comfy")
    keys = {"path": str(files["configs"]), "diffusion_model": str(files["diffusion_model"]), "vae": str(files["vae"])}
    keys["text_encoders"] = [{"path": str(files["text_encoders"][0]), "type": "cosmos"}]
    assert_trains_as(train_from_files(tmp_path, config, keys, procs=2), predict2_run)
