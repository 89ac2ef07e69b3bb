"""Anima from the files ComfyUI users keep (issue 35): the transformer and LLM adapter in one file in ComfyUI's layout
(``anima-base.safetensors``: ``net.`` keys, ``net.llm_adapter.``), Qwen-Image's VAE in the Wan VAE layout, Qwen3 under
``model.``, beside a folder of only configs and tokenizers, loading exactly as the folder; ComfyUI's fp8 scaled and
int8 transformers kept quantized (the adapter read dequantized); full fine-tunes export as diffusers folders and as
the single file, both loading back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_core.quantize import ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.component_files import (
    assert_loads_as_the_folder,
    comfyui_files,
    dequantized_state,
    files_config,
    quantizable_linears,
    quantize_file,
)
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_cosmos.anima import anima as plugin
from diffpipe_cosmos.anima_files import layout_for_config
from diffpipe_cosmos.config import AnimaConfig
from diffpipe_cosmos.testing_anima import comfy_path

CPU = torch.device("cpu")


def anima_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI's Anima files: its own ComfyUI file (transformer and adapter) as ``diffusion_model``."""
    files = comfyui_files(folder, out, layout_for_config, wan_vae_table, {"text_encoder": "model."})
    files["diffusion_model"] = comfy_path(folder)
    return files


def from_files(files: dict, **keys):
    return files_config(AnimaConfig, "anima", files, "qwen3_06b", **keys)


def test_component_files_load_exactly_the_folders_weights(tiny_anima: Path, tmp_path: Path) -> None:
    files = anima_files(tiny_anima, tmp_path)
    assert "net.llm_adapter.blocks.0.cross_attn.q_proj.weight" in load_file(str(files["diffusion_model"]))
    cfg = from_files(files)
    folder = validate(AnimaConfig, {"type": "anima", "path": tiny_anima, "encoder_dtype": "float32"}, "test")
    assert_loads_as_the_folder(plugin, cfg, folder, ("vae", "text_encoder"))
    lines = "\n".join(plugin.model_file_lines(cfg))
    assert f"diffusion_model: {files['diffusion_model']}: Anima (ComfyUI) layout" in lines
    assert "(Qwen3Model)" in lines and "(AutoencoderKLQwenImage)" in lines


@pytest.mark.parametrize(("form", "storage"), [("fp8_scaled", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_a_quantized_transformer_stays_quantized(tiny_anima: Path, tmp_path: Path, form: str, storage) -> None:
    files = anima_files(tiny_anima, tmp_path)
    quantized = quantize_file(files["diffusion_model"], tmp_path / f"anima_{form}.safetensors", form)
    assert load_file(str(quantized))["net.llm_adapter.blocks.0.self_attn.q_proj.weight"].dtype == storage
    cfg = from_files(files, diffusion_model=quantized)
    assert plugin.validate_model_files(cfg) == []
    model = plugin.load_diffusion_model(cfg, CPU, torch.bfloat16)
    plain = plugin.load_diffusion_model(from_files(files), CPU, torch.bfloat16)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    expected = {n for n in quantizable_linears(plain) if not n.startswith("text_conditioner.")}
    assert kept and set(kept) == expected and all(m.weight.dtype == storage for m in kept.values())
    assert f"{len(kept)} linears kept quantized" in plugin.model_file_lines(cfg)[0]
    # the adapter is read dequantized: the quantized file's values, in full precision
    stored = {k.removeprefix("net.llm_adapter."): v for k, v in dequantized_state(quantized).items()
              if k.startswith("net.llm_adapter.")}
    adapter_state = model.text_conditioner.state_dict()
    assert adapter_state.keys() == stored.keys()
    assert all(torch.equal(v, stored[k].to(v.dtype)) for k, v in adapter_state.items())
    assert not any(isinstance(m, ScaledLinear) for m in model.text_conditioner.modules())
    registry = Registry()
    assert registry.register_model("anima", plugin).ok
    assert_stages_read_their_own(registry.model("anima"), cfg)


def test_full_model_exports_load_back(tiny_anima: Path, tmp_path: Path) -> None:
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

    cfg = validate(AnimaConfig, {"type": "anima", "path": tiny_anima, "dtype": "float32"}, "test")
    model = plugin.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():  # "fine-tuned"
        model.transformer_blocks[1].ff.net[2].weight.add_(1.0)
        model.text_conditioner.blocks[0].cross_attn.k_proj.weight.add_(1.0)
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(plugin, model, cfg, saved)
    single = saved / "single_file" / plugin.single_file_name
    assert "net.llm_adapter.blocks.0.cross_attn.k_proj.weight" in load_file(str(single))  # as diffusion-pipe saves
    from_single = plugin.load_diffusion_model(
        validate(AnimaConfig, {"type": "anima", "path": tiny_anima, "dtype": "float32", "diffusion_model": single},
                 "test"), CPU, torch.float32).state_dict()
    from_folder = CosmosTransformer3DModel.from_pretrained(str(saved / "diffusers" / "transformer")).state_dict()
    adapter = AnimaTextConditioner.from_pretrained(str(saved / "diffusers" / "text_conditioner")).state_dict()
    from_folder.update({f"text_conditioner.{k}": v for k, v in adapter.items()})
    for key, value in state.items():
        assert torch.equal(from_single[key], value) and torch.equal(from_folder[key], value), key


def test_configs_from_the_hugging_face_cache(tiny_anima: Path, tmp_path: Path, monkeypatch) -> None:
    """Without ``path``, the cache's snapshot of the diffusers repository (configs and tokenizers only) serves."""
    from diffpipe_core.testing.component_files import hub_snapshot

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    files = anima_files(tiny_anima, tmp_path / "comfy")
    snapshot = hub_snapshot(tiny_anima, tmp_path / "hub", "circlestone-labs/Anima-Base-v1.0-Diffusers")
    table = {"type": "anima", "diffusion_model": files["diffusion_model"], "vae": files["vae"],
             "text_encoders": [{"path": files["text_encoders"][0], "type": "qwen3_06b"}]}
    cfg = validate(AnimaConfig, table, "test")
    assert cfg.path == snapshot and plugin.validate_model_files(cfg) == []
