"""Wan 2.2 TI2V 5B image-to-video (``wan-ti2v``, issue 41) against ``WanImageToVideoPipeline`` on a TI2V folder
(``expand_timesteps``): the clean first latent frame is the pipeline's ``latent_condition`` of the image alone and
the per-token times its ``first_frame_mask[0][0][:, ::2, ::2] * t``; the layers chained compute the transformer
with per-token times; the loss leaves the given frame out; samples equal the pipeline's for the same seed (and,
without a sample image, ``WanPipeline``'s on the TI2V folder); a non-TI2V folder is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from test_wan_encoding import config, frames

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.parts.flow import flow_loss
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.schema import validate
from diffpipe_core.testing.media import write_png
from diffpipe_core.testing.sampling import registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_wan.ti2v import wan_ti2v

CPU = torch.device("cpu")
STEPS, SEED, FRAMES, W, H = 3, 5, 5, 64, 32  # 32-pixel patches of the 16x VAE: a 2 x 4 latent grid


def test_clean_first_frame_and_token_times_are_the_pipelines(tiny_wan_ti2v: Path) -> None:
    from diffusers import WanImageToVideoPipeline

    cfg = config(wan_ti2v, tiny_wan_ti2v, text_max_length=8)
    assert wan_ti2v.validate_model_files(cfg) == []
    enc = wan_ti2v.load_encoders(model_config=cfg, device=CPU)
    video = frames(2, 5, 32, 64, seed=1)
    media = wan_ti2v.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video))
    assert media["latents"].shape == (2, 4, 2, 2, 4)

    pipe = WanImageToVideoPipeline.from_pretrained(str(tiny_wan_ti2v), local_files_only=True)
    assert pipe.config.expand_timesteps
    outs = [pipe.prepare_latents(v[:, 0][None], 1, 4, 32, 64, 5, torch.float32, CPU) for v in video]
    condition, mask = torch.cat([o[1] for o in outs]), outs[0][2]
    assert condition.shape == (2, 4, 1, 2, 4)  # the image encoded alone: one latent frame
    torch.testing.assert_close(media["latents"][:, :, :1], condition, rtol=1e-5, atol=1e-6)

    batch = {**media, "text_embeds": torch.randn(2, 8, 32)}
    (x, t, _), (velocity, weight) = wan_ti2v.prepare_inputs(
        batch=batch, context=TrainingContext(cfg), generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(x[:, :, 0], media["latents"][:, :, 0])  # the first latent frame clean
    step = t[:, -1]  # each sample's time on the generated frames
    t5 = step.view(-1, 1, 1, 1)
    clean, noise = media["latents"][:, :, 1], (velocity + media["latents"])[:, :, 1]
    assert torch.allclose(x[:, :, 1], (1 - t5) * clean + t5 * noise, atol=1e-6)
    for i in range(2):  # the pipeline's per-token timestep for this time
        assert torch.equal(t[i], (mask[0][0][:, ::2, ::2] * step[i]).flatten())
    assert weight.shape == (2, 1, 2, 2, 4) and not weight[:, :, 0].any() and weight[:, :, 1].all()


def test_layers_with_token_times_compute_the_transformer_and_skip_the_given_frame(tiny_wan_ti2v: Path) -> None:
    from test_wan_loading import run_layers

    cfg = config(wan_ti2v, tiny_wan_ti2v, text_max_length=8)
    model = wan_ti2v.load_diffusion_model(cfg, CPU, torch.float32)
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(2, 4, 3, 2, 4, generator=g), "text_embeds": torch.randn(2, 8, 32, generator=g)}
    inputs, targets = wan_ti2v.prepare_inputs(batch, TrainingContext(cfg), torch.Generator().manual_seed(1))
    x, t, text = inputs
    assert t.shape == (2, 3 * 1 * 2) and not t[:, :2].any() and t[:, 2:].all()
    with torch.no_grad():
        want = model(x, t * 1000, text).sample
        assert torch.equal(run_layers(wan_ti2v, model, cfg, inputs), want)
    pred = run_layers(wan_ti2v, model, cfg, inputs).detach().requires_grad_()
    flow_loss((pred,), targets).backward()
    assert not pred.grad[:, :, 0].any() and pred.grad[:, :, 1:].abs().sum() > 0  # no loss on the given frame


@pytest.mark.parametrize("image", [True, False], ids=["image-to-video", "text-to-video"])
def test_samples_equal_the_pipeline(tiny_wan_ti2v: Path, tmp_path: Path, image: bool) -> None:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    first = write_png(tmp_path / "first.png", 80, 40, seed=4)  # resized to 64x32 as the pipeline resizes it
    table = {"type": "wan-ti2v", "path": tiny_wan_ti2v, "dtype": "float32", "encoder_dtype": "float32"}
    cfg = validate(wan_ti2v.spec.config_schema, {**table, **({"sample_image": first} if image else {})}, "t")
    handle = registered(wan_ti2v)
    (texts,) = encode_prompts(handle, cfg, ["a red cat walks"], "blurry", CPU)
    request = SampleRequest(width=W, height=H, frames=FRAMES, steps=STEPS)
    ours = sample_latents(handle, cfg, request, texts, SEED, 2.0)

    kind = WanImageToVideoPipeline if image else WanPipeline
    pipe = kind.from_pretrained(str(tiny_wan_ti2v), torch_dtype=torch.float32, local_files_only=True)
    kwargs = {"image": Image.open(first).convert("RGB")} if image else {}
    expected = pipe(
        prompt_embeds=texts.cond["text_embeds"], negative_prompt_embeds=texts.uncond["text_embeds"],
        guidance_scale=2.0, latents=torch.randn((1, 4, 2, 2, 4), generator=noise_generator(SEED, 0)),
        num_inference_steps=STEPS, height=H, width=W, num_frames=FRAMES, output_type="latent", **kwargs,
    ).frames
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_a_folder_without_expand_timesteps_is_named(tiny_wan: Path) -> None:
    (problem,) = wan_ti2v.validate_model_files(config(wan_ti2v, tiny_wan, text_max_length=8))
    assert "expand_timesteps is not set: not a Wan 2.2 TI2V folder" in problem and str(tiny_wan) in problem
