"""Wan Fun-Control (``wan-fun``, issue 41). diffusers has no Fun pipeline, so the reference is ComfyUI's reading of
the checkpoints (``WanFunControlToVideo`` / ``Wan22FunControlToVideo`` and ``WAN21.concat_cond``): the control
latents are the VAE's normalised posterior mode, concatenated after the noisy latents with zero start-image latents
(and, for Wan 2.2's 52 channels, a zero mask between). Tested: the conditioning equals that, computed here from the
VAE and its ``latents_mean`` / ``latents_std``; Wan's layers chained equal ``WanTransformer3DModel.forward`` on the
wider input; the conformance kit; samples equal ``WanPipeline``'s loop with the condition concatenated to the
transformer's input (as ComfyUI concatenates ``c_concat``); the original-layout single file (ComfyUI's
``wan2.1_fun_control_*``) loads as the folder; a transformer of another layout is refused by name; and one short
CLI run: the loss falls and the LoRA reproduces the trained transformer in diffusers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.schema import validate
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.media import write_video
from diffpipe_core.testing.sampling import registered, sample_latents
from diffpipe_core.types import EncodeBatch, SampleRequest
from diffpipe_wan.control_video import read_clip
from diffpipe_wan.fun import wan_fun
from diffpipe_wan.fun_encoding import condition
from diffpipe_wan.layers import split_into_layers
from diffpipe_wan.testing import single_file_path

W, H, FRAMES, STEPS, SEED = 48, 32, 5, 3, 5
TABLE = {"type": "wan-fun", "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 8}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe(tiny_wan_fun: Path):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(str(tiny_wan_fun), dtype=torch.float32, local_files_only=True)


def comfy_latents(vae, video: torch.Tensor) -> torch.Tensor:
    """ComfyUI's ``Wan21`` latent format ``process_in`` of the VAE's mean: ``(z - mean) / std`` per channel."""
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def test_conditioning_is_comfyuis(pipe, tiny_wan_fun: Path) -> None:
    video = torch.rand(2, 3, FRAMES, H, W, generator=torch.Generator().manual_seed(0)) * 2 - 1
    encoders = wan_fun.load_encoders(validate(wan_fun.spec.config_schema, {**TABLE, "path": tiny_wan_fun}, "t"), CPU)
    cached = wan_fun.encode_batch(encoders=encoders, batch=EncodeBatch(pixels=video, control_index=0))["latents"]
    expected = comfy_latents(pipe.vae, video)
    torch.testing.assert_close(cached, expected, rtol=1e-5, atol=1e-5)
    z = expected.shape[1]
    wan21 = condition(cached, 3 * z)  # WanFunControlToVideo: [control | start image (zeros)]
    torch.testing.assert_close(wan21, torch.cat([expected, torch.zeros_like(expected)], 1), rtol=1e-5, atol=1e-5)
    wan22 = condition(cached, 3 * z + 4)  # Wan22FunControlToVideo: [control | 1 - ones (4) | start image (zeros)]
    assert wan22.shape[1] == 2 * z + 4 and torch.equal(wan22[:, :z], cached) and not wan22[:, z:].any()
    with pytest.raises(ValueError, match="takes 12 or 16 channels for 4 latent channels, not 9"):
        condition(cached, 9)


def test_layers_chained_equal_the_forward(pipe) -> None:
    model = pipe.transformer
    assert model.config.in_channels == 12
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, 2, 4, 6, generator=g)
    t, text = torch.rand(2, generator=g), torch.randn(2, 8, 32, generator=g)
    with torch.no_grad():
        expected = model(x, t * 1000, text, return_dict=False)[0]
        out = (x, t, text)
        for layer in split_into_layers(model):
            out = layer(out)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def write_control(tmp_path: Path, seed: int) -> Path:
    return write_video(tmp_path / f"control-{seed}.mp4", FRAMES + 3, fps=16, size=(60, 40), seed=seed)


def test_wan_fun_conforms(tiny_wan_fun: Path, tmp_path: Path) -> None:
    pixels = torch.rand(2, 3, FRAMES, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    table = {**TABLE, "path": tiny_wan_fun, "sample_control": write_control(tmp_path, 1)}
    check_model_plugin(wan_fun, "wan-fun", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])


def test_sample_equals_wan_pipeline_with_the_condition_concatenated(tiny_wan_fun: Path, tmp_path: Path, pipe) -> None:
    """The core's loop over the layers equals ``WanPipeline``'s loop (its scheduler, guidance, transformer) where the
    transformer's input is the latents with the control video's condition concatenated, as ComfyUI runs Fun-Control."""
    control = write_control(tmp_path, 2)
    cfg = validate(wan_fun.spec.config_schema, {**TABLE, "path": tiny_wan_fun, "sample_control": control}, "test")
    handle = registered(wan_fun)
    (texts,) = encode_prompts(handle, cfg, ["a red cat walks"], "blurry", CPU)
    ours = sample_latents(handle, cfg, SampleRequest(width=W, height=H, frames=FRAMES, steps=STEPS), texts, SEED, 2.0)

    video = read_clip(control, (W, H, FRAMES), wan_fun.spec)[None]
    cond = condition(comfy_latents(pipe.vae, video), 12)
    transformer, forward = pipe.transformer, pipe.transformer.forward
    transformer.forward = lambda hidden_states, *a, **k: forward(
        torch.cat([hidden_states, cond.expand(hidden_states.shape[0], -1, -1, -1, -1)], 1), *a, **k)
    try:
        expected = pipe(
            prompt_embeds=texts.cond["text_embeds"],
            negative_prompt_embeds=texts.uncond["text_embeds"],
            guidance_scale=2.0,
            latents=torch.randn((1, 4, 2, H // 8, W // 8), generator=noise_generator(SEED, 0)),
            num_inference_steps=STEPS, height=H, width=W, num_frames=FRAMES, output_type="latent",
        ).frames
    finally:
        del transformer.forward
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_the_original_fun_file_loads_as_the_folder_and_other_layouts_are_named(tiny_wan_fun: Path, tiny_wan: Path,
                                                                                tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    file = single_file_path(tiny_wan_fun)
    original = load_file(str(file))
    assert original["patch_embedding.weight"].shape[1] == 12 and "blocks.0.self_attn.q.weight" in original
    cfg = validate(wan_fun.spec.config_schema, {**TABLE, "path": tiny_wan_fun, "diffusion_model": file}, "test")
    assert wan_fun.validate_model_files(cfg) == []
    single = wan_fun.load_diffusion_model(cfg, CPU, torch.float32).state_dict()
    folder = load_file(str(tiny_wan_fun / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert single.keys() == folder.keys() and all(torch.equal(single[k], folder[k]) for k in folder)

    t2v = validate(wan_fun.spec.config_schema, {**TABLE, "path": tiny_wan}, "test")
    assert wan_fun.validate_model_files(t2v) == [
        f"{tiny_wan / 'transformer' / 'config.json'}: in_channels 4 is not a Wan Fun-Control transformer's (12: Wan "
        "2.1 Fun-Control, 16: Wan 2.2 Fun-Control, for 4 latent channels); a text-to-video transformer trains as "
        "'wan', an image-to-video / Fun-InP one as 'wan-i2v'"]
    # a Fun file beside the text-to-video folder's configs builds as the file says (in_channels from its tensors)
    beside = validate(wan_fun.spec.config_schema, {**TABLE, "path": tiny_wan, "diffusion_model": file}, "test")
    assert wan_fun.validate_model_files(beside) == []
    v11 = tmp_path / "fun_v1.1.safetensors"  # Fun V1.1's reference-image conv, which diffusers' model lacks
    save_file({**original, "ref_conv.weight": torch.zeros(24, 4, 2, 2)}, str(v11))
    cfg = validate(wan_fun.spec.config_schema, {**TABLE, "path": tiny_wan_fun, "diffusion_model": v11}, "test")
    assert wan_fun.validate_model_files(cfg) == [f"{v11}: a Wan Fun V1.1 transformer (ref_conv: its reference image "
                                                 "or camera control); wan-fun trains Fun-Control files without them "
                                                 "(V1.0: Wan2.1-Fun-*-Control, ComfyUI's wan2.1_fun_control_*)"]
