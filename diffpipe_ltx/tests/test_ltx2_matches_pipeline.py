"""LTX-2: what diffpipe-ltx caches and feeds the transformer is what the diffusers pipelines do with the same tiny
Gemma 3, connectors, VAE and transformer, captured from real pipeline runs: the text (``LTX2Pipeline.encode_prompt``
through the connectors: the transformer's ``encoder_hidden_states``, ``audio_encoder_hidden_states`` and mask), the
first-frame conditioning of ``LTX2ImageToVideoPipeline`` (the image latents on the first frame, per-token timesteps
0 there); the layers chained equal the transformer's forward (with and without a conditioned first frame), and
``prepare_inputs`` builds the conditioning and the audio stream as documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.schema import validate
from diffpipe_ltx.config import LTX2Config
from diffpipe_ltx.ltx2 import FRAME_RATE
from diffpipe_ltx.ltx2 import ltx2 as plugin
from diffpipe_ltx.ltx2_layers import split
from diffpipe_ltx.packing import pack

CPU = torch.device("cpu")
LENGTH = 16
CALL = dict(  # LTX2Pipeline without guidance terms: one transformer call per step
    guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=1.0,
    audio_stg_scale=0.0, audio_modality_scale=1.0, audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
    max_sequence_length=LENGTH, num_inference_steps=2, height=64, width=64, num_frames=9, frame_rate=FRAME_RATE,
    output_type="latent",
)


def config(path: Path, **extra) -> LTX2Config:
    table = {"type": "ltx-2", "path": path, "dtype": "float32", "encoder_dtype": "float32",
             "max_sequence_length": LENGTH, **extra}
    return validate(LTX2Config, table, "test")


def captured_call(pipe, **kwargs) -> dict:
    """The keyword arguments of the pipeline's (first) transformer call."""
    seen: dict = {}

    def hook(module, args, kw):
        seen.setdefault("kw", kw)

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        pipe(**{**CALL, **kwargs})
    finally:
        handle.remove()
    return seen["kw"]


def run_layers(model, cfg: LTX2Config, inputs: tuple) -> torch.Tensor:
    x = inputs
    for layer in plugin.split_into_layers(model=model, model_config=cfg):
        x = layer(x)
    return x[0]


@pytest.fixture(scope="module")
def encoders(tiny_ltx2: Path):
    return plugin.load_encoders(model_config=config(tiny_ltx2), device=CPU)


def test_text_and_transformer_call_as_ltx2_pipeline(tiny_ltx2: Path, encoders) -> None:
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(tiny_ltx2), local_files_only=True)
    captions = ["a red cat", "a photo of a dog on a tree with a car"]
    kw = captured_call(pipe, prompt=captions, generator=torch.Generator().manual_seed(0))
    text = plugin.encode_batch(encoders=encoders, batch=EncodeBatch(captions=captions))
    assert text["video_text"].shape == (2, LENGTH, 16)
    assert torch.allclose(text["video_text"], kw["encoder_hidden_states"], atol=1e-6)
    assert torch.allclose(text["audio_text"], kw["audio_encoder_hidden_states"], atol=1e-6)
    assert not torch.allclose(text["video_text"], text["audio_text"])  # two connectors, two streams
    assert torch.equal(text["text_mask"], kw["encoder_attention_mask"].bool())

    # the same call through diffpipe's layers: the pipeline's latents, time and coordinates
    cfg = config(tiny_ltx2)
    f, h, w = 2, 2, 2
    assert kw["num_frames"] == f and kw["height"] == h and kw["width"] == w and kw["fps"] == FRAME_RATE
    assert kw["use_cross_timestep"] and kw["audio_num_frames"] == plugin.geometry(cfg).audio_frames(f)
    t = kw["timestep"].float() / 1000
    inputs = (kw["hidden_states"], t[:, None].expand(2, f), kw["audio_hidden_states"], text["video_text"],
              text["audio_text"], text["text_mask"], torch.tensor([f, h, w]))
    model = plugin.load_diffusion_model(model_config=cfg, device=CPU, dtype=torch.float32)
    with torch.no_grad():
        expected_video, expected_audio = pipe.transformer(**{**kw, "return_dict": False})
        video, audio = split(run_layers(model, cfg, inputs), f * h * w, 4, kw["audio_num_frames"])
    assert torch.allclose(video, expected_video, atol=1e-5)
    assert torch.allclose(audio, expected_audio, atol=1e-5)


def test_first_frame_conditioning_as_ltx2_image_to_video(tiny_ltx2: Path, encoders) -> None:
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    pipe = LTX2ImageToVideoPipeline.from_pretrained(str(tiny_ltx2), local_files_only=True)
    g = torch.Generator().manual_seed(1)
    pixels = (torch.rand(64, 64, 3, generator=g) * 255).to(torch.uint8).numpy()
    image = Image.fromarray(pixels)
    kw = captured_call(pipe, prompt="a red cat", image=image, image_crf=0, generator=torch.Generator().manual_seed(0))
    first = pipe.video_processor.preprocess(image, height=64, width=64)  # what the pipeline encodes, in [-1, 1]
    clip = torch.cat([first[:, :, None]] + [torch.rand(1, 3, 8, 64, 64, generator=g) * 2 - 1], dim=2)
    media = plugin.encode_batch(encoders=encoders, batch=EncodeBatch(pixels=clip, first_frames=first))
    assert media["latents"].shape == (1, 4, 2, 2, 2) and media["first_frame_latents"].shape == (1, 4, 1, 2, 2)
    tokens = 2 * 2
    assert torch.allclose(pack(media["first_frame_latents"]), kw["hidden_states"][:, :tokens], atol=1e-5)

    # prepare_inputs with p = 1: the same first-frame tokens, timestep 0 there (the pipeline's t * (1 - mask))
    cfg = config(tiny_ltx2, first_frame_conditioning_p=1.0)
    text = plugin.encode_batch(encoders=encoders, batch=EncodeBatch(captions=["a red cat"]))
    batch = {**media, **text}
    (x, t, audio, *_), (target, weight) = plugin.prepare_inputs(
        batch=batch, context=TrainingContext(model_config=cfg), generator=torch.Generator().manual_seed(3)
    )
    assert torch.allclose(x[:, :tokens], kw["hidden_states"][:, :tokens], atol=1e-5)
    per_token = t.repeat_interleave(tokens, dim=1) * 1000
    expected_t = kw["timestep"][:, None] if kw["timestep"].dim() == 1 else kw["timestep"]
    assert torch.equal(per_token == 0, expected_t == 0) and (per_token[:, tokens:] > 0).all()
    assert audio.shape == kw["audio_hidden_states"].shape  # the pipeline's audio length for 9 frames at 24 fps
    video_weight, audio_weight = split(weight, 2 * tokens, 4, audio.shape[1])
    assert video_weight[:, :tokens].max() == 0 and video_weight[:, tokens:].min() == 1 and audio_weight.max() == 0
    assert target.shape == weight.shape

    # the layers with the per-token time equal the transformer called as LTX2ImageToVideoPipeline calls it
    model = plugin.load_diffusion_model(model_config=cfg, device=CPU, dtype=torch.float32)
    call = {**kw, "hidden_states": x, "audio_hidden_states": audio, "timestep": per_token,
            "audio_timestep": t[:, -1] * 1000, "sigma": t[:, -1] * 1000, "return_dict": False,
            "encoder_hidden_states": batch["video_text"], "audio_encoder_hidden_states": batch["audio_text"]}
    with torch.no_grad():
        expected_video, expected_audio = pipe.transformer(**call)
        video, sound = split(run_layers(model, cfg, (x, t, audio, *_)), 2 * tokens, 4, audio.shape[1])
    assert torch.allclose(video, expected_video, atol=1e-5)
    assert torch.allclose(sound, expected_audio, atol=1e-5)


def test_images_and_p0_are_not_conditioned(tiny_ltx2: Path, encoders) -> None:
    text = plugin.encode_batch(encoders=encoders, batch=EncodeBatch(captions=["a red cat", "a dog"]))
    g = torch.Generator().manual_seed(0)
    images = plugin.encode_batch(encoders=encoders, batch=EncodeBatch(pixels=torch.rand(2, 3, 64, 64, generator=g)))
    assert images["latents"].shape == (2, 4, 1, 2, 2) and "first_frame_latents" not in images
    ctx = TrainingContext(model_config=config(tiny_ltx2, first_frame_conditioning_p=1.0))
    (x, t, audio, *_), (_, weight) = plugin.prepare_inputs(
        batch={**images, **text}, context=ctx, generator=torch.Generator().manual_seed(0)
    )
    assert (t > 0).all() and weight[:, : x.numel() // 2].min() == 1 and audio.shape[1] == 1
    clip = torch.rand(2, 3, 9, 64, 64, generator=g) * 2 - 1
    media = plugin.encode_batch(encoders=encoders, batch=EncodeBatch(pixels=clip, first_frames=clip[:, :, 0]))
    ctx0 = TrainingContext(model_config=config(tiny_ltx2))
    first, second = (
        plugin.prepare_inputs(batch={**media, **text}, context=c, generator=torch.Generator().manual_seed(5))
        for c in (ctx0, TrainingContext(model_config=config(tiny_ltx2, first_frame_conditioning_p=1.0)))
    )
    assert (first[0][1] > 0).all() and (second[0][1][:, 0] == 0).all()
    assert torch.equal(first[0][0][:, 4:], second[0][0][:, 4:])  # p changes no other draw
    assert torch.equal(first[0][2], second[0][2])
