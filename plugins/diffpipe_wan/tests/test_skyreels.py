"""SkyReels V2 (issue 41) in process: the layers chained equal ``SkyReelsV2Transformer3DModel.forward`` (per-sample
and per-frame times, the frame-rate embedding, block-causal attention, image-to-video); diffusion forcing's
per-frame times (FoPP: non-decreasing, one per causal block); text and image-to-video conditioning equal the
pipelines'; samples equal ``SkyReelsV2Pipeline``, ``SkyReelsV2DiffusionForcingPipeline`` (synchronous and
asynchronous) and ``SkyReelsV2ImageToVideoPipeline`` for the same seed; ComfyUI's component files load as the
folder, whole and per stage; bad settings are named; both entry points pass the conformance kit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from test_wan_sampling import FRAMES, SEED, STEPS, H, W, noise, pipeline_latents, sample

from diffpipe_core import EncodeBatch
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.schema import validate
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.media import write_png
from diffpipe_core.testing.sampling import assert_same_sample, registered
from diffpipe_wan.skyreels import skyreels_v2, skyreels_v2_i2v
from diffpipe_wan.skyreels_df import fopp_levels, frame_times
from diffpipe_wan.skyreels_layers import split_into_layers

CPU = torch.device("cpu")
TABLE = {"dtype": "float32", "encoder_dtype": "float32"}


def config(plugin, path: Path, **kw):
    return validate(plugin.spec.config_schema, {"type": plugin.spec.name, "path": path, **TABLE, **kw}, "test")


def transformer(folder: Path):
    from diffusers import SkyReelsV2Transformer3DModel

    return SkyReelsV2Transformer3DModel.from_pretrained(str(folder / "transformer")).eval()


def chained(layers, inputs):
    out = inputs
    for layer in layers:
        out = layer(out)
    return out[0]


# ---------------------------------------------------------------------------------------------- layers
@pytest.mark.parametrize("case", ["t2v", "df", "df causal", "i2v"])
def test_layers_chained_equal_the_forward(case: str, tiny_skyreels, tiny_skyreels_df, tiny_skyreels_i2v) -> None:
    folder = {"t2v": tiny_skyreels, "i2v": tiny_skyreels_i2v}.get(case, tiny_skyreels_df)
    model = transformer(folder)
    g = torch.Generator().manual_seed(1)
    forcing = case.startswith("df")
    b, frames = (1, 4) if forcing else (2, 2)  # the forward adds the fps embedding right for one sample only
    x = torch.randn(b, model.config.in_channels, frames, 4, 6, generator=g)
    t = torch.rand((b, frames) if forcing else (b,), generator=g)
    text = torch.randn(b, 512 if case == "i2v" else 8, 32, generator=g)
    image = (torch.randn(b, 5, 16, generator=g),) if case == "i2v" else ()
    per_block = 2 if case == "df causal" else 1
    if forcing:
        assert model.config.inject_sample_info  # the frame-rate embedding counts
    model._set_ar_attention(per_block)  # what the DF pipeline does with causal_block_size
    layers = split_into_layers(model, 24.0, per_block)
    with torch.no_grad():
        ours = chained(layers, (x, t, text, *image))
        kwargs = {"enable_diffusion_forcing": True, "fps": [1] * b} if forcing else {}
        theirs = model(x, t.float() * 1000, text, image[0] if image else None, return_dict=False, **kwargs)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    if case == "df causal":  # a later block's frames do not reach an earlier block's
        x2 = x.clone()
        x2[:, :, 2:] += 1
        with torch.no_grad():
            moved = chained(layers, (x2, t, text))
        torch.testing.assert_close(moved[:, :, :2], ours[:, :, :2], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(moved[:, :, 2:], ours[:, :, 2:])


# ---------------------------------------------------------------------------------------------- DF times
def test_fopp_levels_never_decrease_and_cover_the_levels() -> None:
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([fopp_levels(6, g, levels=50) for _ in range(400)])
    assert (draws[:, 1:] >= draws[:, :-1]).all()
    assert draws.min() >= 0 and draws.max() < 50
    assert draws.float().std(0).min() > 5  # every frame's level varies
    again = torch.stack([fopp_levels(6, torch.Generator().manual_seed(0), levels=50) for _ in range(1)])
    assert torch.equal(again[0], fopp_levels(6, torch.Generator().manual_seed(0), levels=50))
    one = torch.stack([fopp_levels(1, g, levels=10) for _ in range(2000)]).flatten()
    assert torch.bincount(one, minlength=10).min() > 140  # a single frame: uniform over the levels


def test_frame_times_are_per_causal_block_and_in_range(tiny_skyreels_df: Path) -> None:
    cfg = config(skyreels_v2, tiny_skyreels_df, min_t=0.2, max_t=0.9, timestep_sample_method="uniform")
    g = torch.Generator().manual_seed(3)
    t = frame_times(3, 6, 2, cfg, 1.0, (0.2, 0.9), g)
    assert t.shape == (3, 6)
    assert torch.equal(t[:, 0::2], t[:, 1::2])  # a block's frames share their time
    assert (t[:, 1:] >= t[:, :-1]).all() and t.min() >= 0.2 and t.max() <= 0.9
    evaluating = frame_times(2, 4, 1, cfg, 1.0, (0.0, 1.0), g, quantile=0.25)
    assert torch.allclose(evaluating, torch.full((2, 4), 0.25))


def test_diffusion_forcing_inputs_are_noised_per_frame(tiny_skyreels_df: Path) -> None:
    from diffpipe_core import TrainingContext

    cfg = config(skyreels_v2, tiny_skyreels_df, text_max_length=8)
    latents = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    batch = {"latents": latents, "text_embeds": torch.randn(2, 8, 32)}
    context = TrainingContext(model_config=cfg, step=0)
    (x_t, t, text), (target,) = skyreels_v2.prepare_inputs(batch, context, torch.Generator().manual_seed(1))
    assert t.shape == (2, 3) and (t[:, 1:] >= t[:, :-1]).all()
    noise = target + latents
    expected = (1 - t.view(2, 1, 3, 1, 1)) * latents + t.view(2, 1, 3, 1, 1) * noise
    torch.testing.assert_close(x_t, expected)
    plain = config(skyreels_v2, tiny_skyreels_df, text_max_length=8, diffusion_forcing=False)
    (_, t_plain, _), _ = skyreels_v2.prepare_inputs(batch, TrainingContext(model_config=plain, step=0),
                                                    torch.Generator().manual_seed(1))  # fmt: skip
    assert t_plain.shape == (2,)


# ---------------------------------------------------------------------------------------------- conditioning
def test_text_and_image_conditioning_are_the_pipelines(tiny_skyreels_i2v: Path, monkeypatch) -> None:
    import importlib.util
    from types import SimpleNamespace

    from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Pipeline
    from diffusers.pipelines.skyreels_v2 import pipeline_skyreels_v2

    if importlib.util.find_spec("ftfy") is None:  # the SkyReels pipelines call ftfy unconditionally; these captions
        # hold nothing ftfy changes (Wan's prompt_clean, which diffpipe uses, skips it when it is not installed)
        monkeypatch.setattr(pipeline_skyreels_v2, "ftfy", SimpleNamespace(fix_text=lambda t: t), raising=False)

    cfg = config(skyreels_v2_i2v, tiny_skyreels_i2v)
    enc = skyreels_v2_i2v.load_encoders(model_config=cfg, device=CPU)
    captions = ["a red  cat &amp; a dog ", ""]
    ours = skyreels_v2_i2v.encode_batch(encoders=enc, batch=EncodeBatch(captions=captions))["text_embeds"]
    pipe = SkyReelsV2Pipeline(tokenizer=enc.tokenizer, text_encoder=enc.text_encoder, vae=None, scheduler=None,
                              transformer=None)  # fmt: skip
    theirs, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=512, device=CPU)
    assert torch.equal(ours, theirs)

    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (1, 3, 5, 32, 48), generator=g).float().div(127.5).sub(1)
    batch = EncodeBatch(pixels=video, first_frames=video[:, :, 0])
    media = skyreels_v2_i2v.encode_batch(encoders=enc, batch=batch)
    i2v = SkyReelsV2ImageToVideoPipeline.from_pretrained(str(tiny_skyreels_i2v), local_files_only=True)
    image = Image.fromarray(((video[0, :, 0] + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())
    pixels = i2v.video_processor.preprocess(image, height=32, width=48)
    with torch.no_grad():
        _, condition = i2v.prepare_latents(pixels, 1, 4, 32, 48, 5, torch.float32, CPU, None, noise_like(media))
        embeds = i2v.encode_image(image, CPU)
    torch.testing.assert_close(media["first_frame_latents"], condition[:, 4:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(media["image_embeds"], embeds, rtol=1e-5, atol=1e-6)


def noise_like(media) -> torch.Tensor:
    return torch.zeros_like(media["latents"])


# ---------------------------------------------------------------------------------------------- samples
def test_t2v_sample_equals_skyreels_v2_pipeline(tiny_skyreels: Path) -> None:
    from diffusers import SkyReelsV2Pipeline

    cfg = config(skyreels_v2, tiny_skyreels, text_max_length=16)
    ours, texts, _ = sample(skyreels_v2, cfg, 3.0)
    pipe = SkyReelsV2Pipeline.from_pretrained(str(tiny_skyreels), local_files_only=True)
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    assert_same_sample(ours, pipeline_latents(pipe, texts, 3.0), noise())


@pytest.mark.parametrize(("frames", "ar_step", "block"), [(FRAMES, 0, None), (13, 1, 2)])
def test_df_sample_equals_the_diffusion_forcing_pipeline(tiny_skyreels_df: Path, frames, ar_step, block) -> None:
    """Synchronous (every frame at the same step) and asynchronous (blocks of 2 latent frames, each lagging the one
    before by ``ar_step``: more iterations than steps, each frame stepped by its own scheduler)."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    from diffpipe_core.sampling.prompts import encode_prompts
    from diffpipe_core.testing.sampling import sample_latents
    from diffpipe_core.types import SampleRequest

    cfg = config(skyreels_v2, tiny_skyreels_df, text_max_length=16, ar_step=ar_step, causal_block_size=block)
    handle = registered(skyreels_v2)
    (texts,) = encode_prompts(handle, cfg, ["a red cat walks"], "blurry", CPU)
    request = SampleRequest(width=W, height=H, frames=frames, steps=STEPS)
    ours = sample_latents(handle, cfg, request, texts, SEED, 2.5)
    pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(str(tiny_skyreels_df), local_files_only=True)
    theirs = pipe(
        prompt=None, prompt_embeds=texts.cond["text_embeds"], negative_prompt_embeds=texts.uncond["text_embeds"],
        guidance_scale=2.5, generator=noise_generator(SEED, 0), num_inference_steps=STEPS, height=H, width=W,
        num_frames=frames, ar_step=ar_step, causal_block_size=block, output_type="latent",
    ).frames  # fmt: skip
    start = torch.randn(theirs.shape, generator=noise_generator(SEED, 0))
    assert_same_sample(ours, theirs, start)


def test_i2v_sample_equals_skyreels_v2_image_to_video_pipeline(tiny_skyreels_i2v: Path, tmp_path: Path) -> None:
    from diffusers import SkyReelsV2ImageToVideoPipeline

    image_file = write_png(tmp_path / "first.png", 60, 40, seed=4)
    cfg = config(skyreels_v2_i2v, tiny_skyreels_i2v, sample_image=image_file)
    ours, texts, _ = sample(skyreels_v2_i2v, cfg, 2.0)
    pipe = SkyReelsV2ImageToVideoPipeline.from_pretrained(str(tiny_skyreels_i2v), local_files_only=True)
    expected = pipeline_latents(pipe, texts, 2.0, image=Image.open(image_file).convert("RGB"))
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- files, checks
def test_component_files_load_as_the_folder(tiny_skyreels_df: Path, tmp_path: Path) -> None:
    """ComfyUI's files of the DF model beside a config-only folder: the transformer in the original Wan layout (its
    ``fps_embedding`` / ``fps_projection`` included), the VAE in the original Wan VAE layout, UMT5; every component
    loads exactly as from the folder, and each stage reads only its own tensors of the transformer's file."""
    from diffpipe_core.parts.wan_vae import wan_vae_table
    from diffpipe_core.testing.component_files import assert_loads_as_the_folder, comfyui_files, files_config
    from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
    from diffpipe_wan.skyreels_keys import layout_for_config

    files = comfyui_files(tiny_skyreels_df, tmp_path, layout_for_config, wan_vae_table)
    from_files = files_config(skyreels_v2.spec.config_schema, "skyreels-v2", files, **TABLE)
    assert "model.diffusion_model.fps_projection.0.weight" in safe_keys(files["diffusion_model"])
    assert_loads_as_the_folder(skyreels_v2, from_files, config(skyreels_v2, tiny_skyreels_df),
                               ("vae", "text_encoder"))  # fmt: skip
    assert_stages_read_their_own(registered(skyreels_v2), from_files)


def safe_keys(file: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as opened:
        return set(opened.keys())


def test_bad_settings_are_named(tiny_skyreels: Path, tiny_skyreels_i2v: Path) -> None:
    problems = skyreels_v2.validate_model_files(model_config=config(skyreels_v2, tiny_skyreels, expert="high"))
    assert problems and "expert = 'high' is for Wan 2.2 A14B folders" in problems[0]
    wrong = skyreels_v2.validate_model_files(model_config=config(skyreels_v2, tiny_skyreels_i2v))
    assert wrong and "SkyReelsV2ImageToVideoPipeline" in " ".join(wrong)
    model = transformer(tiny_skyreels)
    layers = split_into_layers(model, 24.0, 2)
    with pytest.raises(ValueError, match="blocks of 2 latent frames; got 3 latent frames"):
        chained(layers, (torch.randn(1, 4, 3, 4, 4), torch.rand(1), torch.randn(1, 8, 32)))


def pixels(frames: int) -> torch.Tensor:
    return torch.rand(2, 3, frames, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_both_entry_points_conform(tiny_skyreels_df: Path, tiny_skyreels_i2v: Path, tmp_path: Path) -> None:
    table = {"type": "skyreels-v2", "path": tiny_skyreels_df, "text_max_length": 8, **TABLE}
    check_model_plugin(skyreels_v2, "skyreels-v2", table, pixels=pixels(5), captions=["a red cat", "a dog"])
    image = write_png(tmp_path / "first.png", 40, 24)
    table = {"type": "skyreels-v2-i2v", "path": tiny_skyreels_i2v, "sample_image": image, **TABLE}
    check_model_plugin(skyreels_v2_i2v, "skyreels-v2-i2v", table, pixels=pixels(5), captions=["a red cat", "a dog"])
