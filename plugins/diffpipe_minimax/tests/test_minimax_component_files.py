"""MiniMax H3's transformer from the single file ComfyUI users keep (the reference layout under
``model.diffusion_model.``: fused ``attn.qkv_proj``, ``mlp.fc1`` halves swapped, ``video_patch_proj`` ...): it loads
exactly the folder's weights, whole and per stage, and as an int8 file (ComfyUI's ``int8_tensorwise``) its linears stay
quantized; ComfyUI's VAE, audio VAE and Qwen3-VL files (its int8 "convrot" one dequantized) load the folder's
components."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.testing.component_files import assert_kept_quantized, component_state, quantize_file, save
from diffpipe_minimax.original import layout_for_config
from diffpipe_minimax.plugin import plugin as minimax

CPU = torch.device("cpu")


def config(folder: Path, **keys: object):
    return minimax.spec.config_schema(type="minimax-h3", path=folder, dtype="float32", encoder_dtype="float32", **keys)


@pytest.fixture(scope="module")
def reference_file(tiny_minimax: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = component_state(tiny_minimax, "transformer")
    config_json = minimax.model_folder_config(config(tiny_minimax))
    original = layout_for_config(config_json).to_original(state)
    assert "blocks.0.attn.qkv_proj.weight" in original
    out = tmp_path_factory.mktemp("comfy") / "minimax_h3.safetensors"
    return save({f"model.diffusion_model.{k}": v for k, v in original.items()}, out)


def test_the_reference_layout_file_loads_the_folders_weights(tiny_minimax: Path, reference_file: Path) -> None:
    from diffpipe_core.registry import Registry
    from diffpipe_core.testing.stage_reads import assert_stages_read_their_own

    cfg = config(tiny_minimax, diffusion_model=reference_file)
    assert minimax.validate_model_files(cfg) == []
    got = minimax.load_diffusion_model(cfg, CPU, torch.float32).state_dict()
    expected = minimax.load_diffusion_model(config(tiny_minimax), CPU, torch.float32).state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    registry = Registry()
    assert registry.register_model("minimax-h3", minimax).ok
    assert_stages_read_their_own(registry.model("minimax-h3"), cfg)


def test_an_int8_file_stays_quantized(tiny_minimax: Path, reference_file: Path, tmp_path: Path) -> None:
    file = quantize_file(reference_file, tmp_path / "minimax_h3_int8.safetensors", "int8")
    assert_kept_quantized(minimax, config(tiny_minimax, diffusion_model=file),
                          config(tiny_minimax, diffusion_model=reference_file), torch.int8)


def test_comfyuis_video_vae_file_loads_the_folders_vae(tiny_minimax: Path, tmp_path: Path) -> None:
    """ComfyUI's video VAE file (the reference layout: ``encoder.down.I.block.J``, the decoder's ``x_embedder``,
    ``to_qkv`` interleaved per head, ``ff.w1`` = ``[gate; up]``, with ``mask_token`` and the latent statistics as
    buffers) loads exactly the folder's VAE."""
    import json

    from safetensors.torch import load_file

    from diffpipe_minimax.testing import comfyui_files

    file = comfyui_files(tiny_minimax, tmp_path)["vae"]
    original, state = load_file(str(file)), component_state(tiny_minimax, "vae")
    heads = json.loads((tiny_minimax / "vae" / "config.json").read_text())["decoder_num_attention_heads"]
    block = "decoder.transformer_blocks.0"
    q, k, v = (state[f"{block}.attn.to_{p}.weight"].unflatten(0, (heads, -1)) for p in "qkv")  # the reference's rows
    assert torch.equal(original[f"{block}.attn.to_qkv.weight"], torch.cat([q, k, v], dim=1).flatten(0, 1))
    up, gate = state[f"{block}.ff.net.0.proj.weight"].chunk(2)
    assert torch.equal(original[f"{block}.ff.w1.weight"], torch.cat([gate, up]))
    assert "encoder.down.0.block.0.conv1.weight" in original and "encoder.down.0.downsample.conv.weight" in original
    cfg = config(tiny_minimax, vae=file)
    assert minimax.validate_model_files(cfg) == []
    got = minimax.load_encoders(cfg, CPU).vae.state_dict()
    expected = minimax.load_encoders(config(tiny_minimax), CPU).vae.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_comfyuis_audio_vae_file_loads_the_folders_audio_vae(tiny_minimax: Path, tmp_path: Path) -> None:
    """ComfyUI's audio VAE file (diffusers' module names, each weight-normed convolution's ``weight_g`` / ``weight_v``
    folded into one ``weight``, the latent statistics as buffers) gives the folder's audio VAE: the same convolutions
    (to float rounding: the file holds their product), every other tensor exactly, and the same latents."""
    from safetensors.torch import load_file

    from diffpipe_minimax.testing import comfyui_files

    file = comfyui_files(tiny_minimax, tmp_path)["audio_vae"]
    original = load_file(str(file))
    assert "decoder.conv_pre.weight" in original and not any(k.endswith(("weight_g", "weight_v")) for k in original)
    cfg = config(tiny_minimax, audio_vae=file)
    assert minimax.validate_model_files(cfg) == []
    got, expected = (minimax.load_decoder(c, CPU).diffpipe_audio for c in (cfg, config(tiny_minimax)))
    got_state, expected_state = got.state_dict(), expected.state_dict()
    assert got_state.keys() == expected_state.keys()
    for name, module in expected.named_modules():
        if hasattr(module, "weight_g"):  # the convolution's weight, however it is split (to float rounding)
            mine = got.get_submodule(name)
            torch.testing.assert_close(torch._weight_norm(mine.weight_v, mine.weight_g, 0),
                                       torch._weight_norm(module.weight_v, module.weight_g, 0))
    assert all(torch.equal(got_state[k], expected_state[k]) for k in got_state if not k.endswith(("_g", "_v")))
    sound = torch.randn(1, 1, 1600, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.encode(sound).latent_dist.mean, expected.encode(sound).latent_dist.mean)


def test_comfyuis_qwen3vl_file_gives_the_folders_text(tiny_minimax: Path, tmp_path: Path) -> None:
    """ComfyUI's Qwen3-VL file (``model.`` / ``visual.``, cut after layer 50 with no final norm and no head) gives
    Qwen3-VL with the folder's weights wherever text encoding reads them, and the same hidden state after layer 50."""
    from diffpipe_minimax.plugin import QWEN3VL_UNUSED, TEXT_LAYER
    from diffpipe_minimax.testing import comfyui_files

    file = comfyui_files(tiny_minimax, tmp_path)["text_encoder"]
    cfg = config(tiny_minimax, text_encoders=[{"path": str(file), "type": "minimax"}])
    assert minimax.validate_model_files(cfg) == []
    got, expected = (minimax.load_encoders(c, CPU).text_encoder for c in (cfg, config(tiny_minimax)))
    got_state, expected_state = got.state_dict(), expected.state_dict()
    assert got_state.keys() == expected_state.keys()
    assert all(torch.equal(got_state[k], expected_state[k]) for k in got_state if not k.startswith(QWEN3VL_UNUSED))
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    states = [m(input_ids=ids, output_hidden_states=True).hidden_states[TEXT_LAYER] for m in (got, expected)]
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)


def test_comfyuis_int8_convrot_qwen3vl_file_loads_dequantized(tiny_minimax: Path, tmp_path: Path) -> None:
    """The int8 "convrot" Qwen3-VL file diffusion-pipe's example names (``qwen3vl_32b_minimax_h3_int8_convrot``):
    every linear's weight loads as the file's value (the int8 rows times their scales, rotated back), the rest as
    stored; the text is the folder's to int8 rounding."""
    from diffpipe_core.testing.component_files import dequantized_state, quantize_file
    from diffpipe_minimax.plugin import QWEN3VL_UNUSED, TEXT_LAYER
    from diffpipe_minimax.testing import comfyui_files

    plain = comfyui_files(tiny_minimax, tmp_path)["text_encoder"]
    file = quantize_file(plain, tmp_path / "qwen3vl_32b_minimax_h3_int8_convrot.safetensors", "int8_convrot")
    cfg = config(tiny_minimax, text_encoders=[{"path": str(file), "type": "minimax"}])
    assert minimax.validate_model_files(cfg) == []
    got, expected = (minimax.load_encoders(c, CPU).text_encoder for c in (cfg, config(tiny_minimax)))
    values, state = dequantized_state(file), got.state_dict()
    renames = (("model.language_model.", "model."), ("model.visual.", "visual."))
    for key, value in state.items():
        if key.startswith(QWEN3VL_UNUSED):
            continue
        stored = next((new + key[len(old):] for old, new in renames if key.startswith(old)), key)
        torch.testing.assert_close(value, values[stored], rtol=1e-6, atol=1e-6)
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    states = [m(input_ids=ids, output_hidden_states=True).hidden_states[TEXT_LAYER] for m in (got, expected)]
    assert not torch.equal(states[0], states[1])
    torch.testing.assert_close(states[0], states[1], rtol=0.05, atol=0.05)
