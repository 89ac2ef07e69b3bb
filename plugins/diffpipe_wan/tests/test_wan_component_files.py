"""Wan from the files ComfyUI users keep (issue 35): the transformer in the original Wan layout, the VAE in the
original Wan VAE layout (ComfyUI's ``wan_2.1_vae.safetensors``, ``wan2.2_vae.safetensors``), UMT5 in transformers'
names (``umt5_xxl_fp16.safetensors``, also fp8 scaled) and Wan 2.1 I2V's CLIP vision encoder
(``clip_vision_h.safetensors``), beside a folder of only configs and tokenizers; ComfyUI's fp8 scaled transformer
kept quantized, each stage reading its own tensors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from diffpipe_core.anchor.keys import toml_key, toml_value
from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_variant_loads_as_itself,
    component_state,
    config_only,
    dequantized_state,
    quantize_file,
    save,
    variant_file,
    variant_model,
    write_component_files,
)
from diffpipe_wan.flf2v import wan_flf2v
from diffpipe_wan.i2v import wan_i2v
from diffpipe_wan.original import layout_for_config
from diffpipe_wan.plugin import wan
from diffpipe_wan.ti2v import wan_ti2v
from diffpipe_wan.umt5 import umt5_table

CPU = torch.device("cpu")
VARIANTS = [("tiny_wan", wan), ("tiny_wan_ti2v", wan), ("tiny_wan_i2v", wan_i2v), ("tiny_wan_flf2v", wan_flf2v),
            ("tiny_wan_ti2v", wan_ti2v)]


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI's Wan files under ``out`` (the image encoder, where the folder has one, listed with the
    text encoders) and a config-only folder ``out/configs``."""
    config = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    files = write_component_files(folder, out, layout_for_config(config), wan_vae_table(vae))
    if (folder / "image_encoder").is_dir():
        files["text_encoders"].append(save(component_state(folder, "image_encoder"), out / "clip_vision_h.st"))
    files["configs"] = config_only(folder, out / "configs")
    return files


def from_files(plugin, files: dict, **keys):
    table = {"type": plugin.spec.name, "path": files["configs"], "diffusion_model": files["diffusion_model"]}
    table.update(vae=files["vae"], text_encoders=files["text_encoders"][::-1], encoder_dtype="float32")
    return validate(plugin.spec.config_schema, {**table, **keys}, "test")


def same_state(got: nn.Module, expected: nn.Module) -> None:
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(("fixture", "plugin"), VARIANTS)
def test_component_files_load_exactly_the_folders_weights(request, tmp_path: Path, fixture: str, plugin) -> None:
    folder = request.getfixturevalue(fixture)
    files = comfy_files(folder, tmp_path)
    cfg = from_files(plugin, files)
    assert plugin.validate_model_files(cfg) == []
    lines = "\n".join(plugin.model_file_lines(cfg))
    assert f"diffusion_model: {files['diffusion_model']}: original Wan layout" in lines
    assert f"vae: {files['vae']}: original Wan VAE layout" in lines
    assert f"text_encoder: {files['text_encoders'][0]}: diffusers" in lines and "(UMT5EncoderModel)" in lines
    original = set(load_file(str(files["vae"])))  # really the original layout
    assert {"encoder.conv1.weight", "decoder.middle.1.to_qkv.weight", "conv2.weight"} <= original
    assert not any("down_blocks" in k or "up_blocks" in k or "quant_conv" in k for k in original)
    folder_cfg = validate(plugin.spec.config_schema, {"type": plugin.spec.name, "path": folder}, "test")
    got, expected = (
        plugin.load_encoders(cfg, CPU),
        plugin.load_encoders(folder_cfg.model_copy(update=dict(encoder_dtype="float32")), CPU),
    )
    names = ["vae", "text_encoder"] + (["image_encoder"] if fixture in ("tiny_wan_i2v", "tiny_wan_flf2v") else [])
    for name in names:
        same_state(getattr(got, name), getattr(expected, name))
    same_state(
        plugin.load_diffusion_model(cfg, CPU, torch.bfloat16),
        plugin.load_diffusion_model(folder_cfg, CPU, torch.bfloat16),
    )


def test_an_a14b_low_noise_expert_file_loads_into_transformer_2(tiny_wan_a14b: Path, tmp_path: Path) -> None:
    """``wan2.2_t2v_low_noise_14B_*`` with ``expert = "low"``: the file replaces ``transformer_2``'s weights."""
    config = json.loads((tiny_wan_a14b / "transformer_2" / "config.json").read_text())
    low = write_component_files(tiny_wan_a14b, tmp_path / "low", layout_for_config(config), model="transformer_2")
    files = comfy_files(tiny_wan_a14b, tmp_path)  # its diffusion_model: the high-noise expert's file
    cfg = from_files(wan, files, diffusion_model=low["diffusion_model"], expert="low")
    assert wan.validate_model_files(cfg) == []
    folder = validate(wan.spec.config_schema, {"type": "wan", "path": tiny_wan_a14b, "expert": "low"}, "test")
    got = wan.load_diffusion_model(cfg, CPU, torch.float32)
    same_state(got, wan.load_diffusion_model(folder, CPU, torch.float32))
    high = wan.load_diffusion_model(from_files(wan, files, expert="high"), CPU, torch.float32)
    assert not torch.equal(high.proj_out.weight, got.proj_out.weight)  # the two experts differ


def test_a_wan_22_vae_file_is_read_in_its_own_layout(tiny_wan_ti2v: Path, tmp_path: Path) -> None:
    """Wan 2.2's VAE nests its residual blocks (``downsamples.I.downsamples.J``), unlike 2.1's flat list."""
    files = comfy_files(tiny_wan_ti2v, tmp_path)
    keys = set(load_file(str(files["vae"])))
    assert "encoder.downsamples.0.downsamples.0.residual.0.gamma" in keys
    assert "decoder.upsamples.0.upsamples.2.resample.1.weight" in keys  # the level's upsampler after its 2 blocks


def test_a_quantized_transformer_stays_quantized(tiny_wan: Path, tmp_path: Path) -> None:
    files = comfy_files(tiny_wan, tmp_path)
    file = quantize_file(files["diffusion_model"], tmp_path / "wan2.1_t2v_fp8_scaled.safetensors", "fp8_scaled")
    cfg = from_files(wan, files, diffusion_model=file)
    assert_kept_quantized(wan, cfg, from_files(wan, files), torch.float8_e4m3fn)


def test_an_fp8_scaled_umt5_loads_dequantized(tiny_wan: Path, tmp_path: Path) -> None:
    files = comfy_files(tiny_wan, tmp_path)
    umt5 = quantize_file(files["text_encoders"][0], tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "fp8_scaled")
    cfg = from_files(wan, files, text_encoders=[umt5])
    encoder = wan.load_encoders(cfg, CPU).text_encoder
    values = dequantized_state(umt5)
    assert any(k.endswith(".scale_weight") for k in load_file(str(umt5)))
    for name, tensor in encoder.state_dict().items():
        if name in values:
            assert torch.equal(tensor, values[name]), name
    assert "quantized scaled" in "\n".join(wan.model_file_lines(cfg))


def test_kijais_original_layout_umt5_loads_exactly(tiny_wan: Path, tmp_path: Path) -> None:
    """The Wan repositories' T5 layout (Kijai's ``umt5-xxl-enc-bf16.safetensors``): ``blocks.N.attn.q``, ..."""
    files = comfy_files(tiny_wan, tmp_path)
    config = json.loads((tiny_wan / "text_encoder" / "config.json").read_text())
    state = umt5_table(config).to_original(component_state(tiny_wan, "text_encoder"))
    assert {"token_embedding.weight", "blocks.0.ffn.gate.0.weight", "blocks.1.pos_embedding.embedding.weight"} <= set(
        state
    )
    kijai = save(state, tmp_path / "umt5-xxl-enc-bf16.safetensors")
    cfg = from_files(wan, files, text_encoders=[kijai])
    assert wan.validate_model_files(cfg) == []
    assert f"text_encoder: {kijai}: original Wan T5 layout" in "\n".join(wan.model_file_lines(cfg))
    folder = validate(wan.spec.config_schema, {"type": "wan", "path": tiny_wan, "encoder_dtype": "float32"}, "test")
    same_state(wan.load_encoders(cfg, CPU).text_encoder, wan.load_encoders(folder, CPU).text_encoder)


def test_a_vae_of_another_model_is_named(tiny_wan: Path, tiny_wan_ti2v: Path, tmp_path: Path) -> None:
    files = comfy_files(tiny_wan, tmp_path / "21")
    other = comfy_files(tiny_wan_ti2v, tmp_path / "22")["vae"]  # Wan 2.2's VAE beside a Wan 2.1 folder
    [problem] = wan.validate_model_files(from_files(wan, files, vae=other))
    assert problem.startswith(f"model.vae: {other}: not the wan vae of ") and "original layout" in problem


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.slow
def test_component_files_train_as_the_folder(wan_run: Path, tmp_path: Path) -> None:
    """The shared ``wan`` run (original single file over the folder), again from ComfyUI files only: equal losses
    and LoRA files."""
    from test_wan_train import STEPS, make_project

    config = make_project(tmp_path)
    files = comfy_files(tmp_path / "model", tmp_path / "comfy")
    keys = {"path": str(files["configs"]), "diffusion_model": str(files["diffusion_model"]), "vae": str(files["vae"])}
    keys["text_encoders"] = [{"path": str(p), "type": "wan"} for p in files["text_encoders"]]
    given = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in keys.items())
    text = re.sub(r"^diffusion_model = .*\n", "", config.read_text(), flags=re.M)
    config.write_text(text.replace('path = "model"\n', given))
    run = runs.train(tmp_path, config, procs=1, timeout=600, OMP_NUM_THREADS="1")
    got, expected = runs.losses(run), runs.losses(wan_run)
    assert len(got) == STEPS and got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    for name in ("adapter_model.safetensors", "adapter_model.comfyui.safetensors"):
        got, want = load_file(str(run / "saved/final" / name)), load_file(str(wan_run / "saved/final" / name))
        assert got.keys() == want.keys()
        assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in got), name


@pytest.mark.parametrize(
    ("fixture", "plugin", "read"),
    [
        ("tiny_wan", wan, {"num_layers": 3, "num_attention_heads": 3, "ffn_dim": 24}),  # 1.3B folder, 14B-like file
        ("tiny_wan_i2v", wan_i2v, {"num_layers": 1, "image_dim": None, "added_kv_proj_dim": None}),  # 2.1 / 2.2 i2v
        ("tiny_wan_i2v", wan_flf2v, {"pos_embed_seq_len": 10}),  # an FLF2V file (img_emb.emb_pos) beside 2.1 i2v
    ],
)
def test_a_file_of_another_variant_loads_as_itself(request, tmp_path: Path, fixture: str, plugin, read: dict) -> None:
    """Other block counts, heads and feed-forward width, or an image-to-video file without the CLIP image embedder
    (Wan 2.2's) beside a Wan 2.1 i2v folder: read from the file's tensors."""
    files = comfy_files(request.getfixturevalue(fixture), tmp_path)
    variant = variant_model(plugin, files["configs"], **read)
    file = variant_file(plugin, variant, tmp_path / "wan.safetensors")
    assert_variant_loads_as_itself(plugin, from_files(plugin, files, diffusion_model=file), variant, read)


def test_a_fun_inp_file_trains_as_wan_i2v(tiny_wan_i2v: Path, tmp_path: Path) -> None:
    """A Wan 2.1 Fun-InP transformer (alibaba-pai's ``Wan2.1-Fun-*-InP``, ComfyUI's ``wan2.1_fun_inp_*``: the original
    i2v layout, ``patch_embedding`` over ``2z + 4`` channels and the CLIP ``img_emb``, at another size than the I2V
    14B) beside the I2V folder's configs loads as itself under ``wan-i2v``, and its first layer gets the layout the
    README documents: ``[x_t | 4 mask channels | first-frame latents]`` as ``WanImageToVideoPipeline.prepare_latents``
    builds them (what ComfyUI's ``WanFunInpaintToVideo`` gives with a start image only); layers chained = forward."""
    from diffusers import WanImageToVideoPipeline
    from test_wan_encoding import frames
    from test_wan_loading import run_layers

    from diffpipe_core import EncodeBatch, TrainingContext

    files = comfy_files(tiny_wan_i2v, tmp_path)
    read = {"num_layers": 3, "num_attention_heads": 3, "ffn_dim": 24, "added_kv_proj_dim": 36}  # a 1.3B-like file
    variant = variant_model(wan_i2v, files["configs"], **read)
    file = variant_file(wan_i2v, variant, tmp_path / "wan2.1_fun_inp.safetensors")
    original = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(str(file)).items()}
    z = variant.config["out_channels"]
    assert original["patch_embedding.weight"].shape[1] == 2 * z + 4 and "img_emb.proj.0.weight" in original
    cfg = from_files(wan_i2v, files, diffusion_model=file)
    assert_variant_loads_as_itself(wan_i2v, cfg, variant, read)

    enc = wan_i2v.load_encoders(model_config=cfg, device=CPU)
    video = frames(2, 9, 32, 48, seed=4)
    media = wan_i2v.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video, first_frames=video[:, :, 0]))
    batch = {**media, "text_embeds": torch.randn(2, 512, 32, generator=torch.Generator().manual_seed(5))}
    (x, t, text, image), _ = wan_i2v.prepare_inputs(batch=batch, context=TrainingContext(cfg),
                                                    generator=torch.Generator().manual_seed(6))
    pipe = WanImageToVideoPipeline.from_pretrained(str(tiny_wan_i2v), local_files_only=True)
    noise = torch.randn(1, z, 3, 4, 6)
    want = torch.cat([pipe.prepare_latents(f[None], 1, z, 32, 48, 9, torch.float32, CPU, latents=noise)[1]
                      for f in video[:, :, 0]])
    assert torch.equal(x[:, z:z + 4], want[:, :4])  # the mask: 1 on the given first frame, 0 after
    torch.testing.assert_close(x[:, z + 4:], want[:, 4:].detach(), rtol=1e-5, atol=1e-6)
    model = wan_i2v.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        forward = model(x, t * 1000, text, encoder_hidden_states_image=image).sample
        assert torch.equal(run_layers(wan_i2v, model, cfg, (x, t, text, image)), forward)
