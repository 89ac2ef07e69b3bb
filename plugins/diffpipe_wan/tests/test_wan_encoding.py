"""Issue test 2: what diffpipe-wan caches and feeds the transformer is what the Wan pipelines compute with the same
tiny encoders: UMT5 text as ``WanPipeline.encode_prompt`` (cleaning, length, trimming, zero padding), the VAE
latents' per-channel normalisation (the inverse of the pipelines' decoding), and for image-to-video the first-frame
latents and mask as ``WanImageToVideoPipeline.prepare_latents`` builds them and the CLIP embedding as its
``encode_image``; the 16x VAE of Wan 2.2 with its 32-pixel patches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.schema import validate
from diffpipe_wan.encoding import denormalize, to_images
from diffpipe_wan.i2v import wan_i2v
from diffpipe_wan.plugin import wan

CPU = torch.device("cpu")


def config(plugin, path: Path, **kw):
    table = {"type": plugin.spec.name, "path": path, "dtype": "float32", "encoder_dtype": "float32", **kw}
    return validate(plugin.spec.config_schema, table, "test")


def frames(b: int, f: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """Pixels as the core decodes them from 8-bit media: ``uint8 / 127.5 - 1``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, f, h, w), generator=g).float().div(127.5).sub(1)


@pytest.mark.parametrize("length", [16, 512])
def test_text_is_wan_pipelines_encode_prompt(tiny_wan: Path, length: int) -> None:
    from diffusers import WanPipeline

    cfg = config(wan, tiny_wan, text_max_length=length)
    enc = wan.load_encoders(model_config=cfg, device=CPU)
    captions = ["a red  cat &amp; a dog ", "a photo of a dog on a tree with a car in the city " * 3, ""]
    ours = wan.encode_batch(encoders=enc, batch=EncodeBatch(captions=captions))["text_embeds"]
    pipe = WanPipeline(tokenizer=enc.tokenizer, text_encoder=enc.text_encoder, vae=None, scheduler=None)
    theirs, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=length, device=CPU)
    assert ours.shape == (3, length, 32)
    assert torch.equal(ours, theirs)
    # the caption's own tokens (cleaned: "a red cat & a dog" + </s>), then exact zeros
    assert ours[0, :7].abs().sum(-1).min() > 0 and not ours[0, 7:].any()
    kept = min(length, len(enc.tokenizer(captions[1].strip()).input_ids))  # the long caption's tokens, truncated
    assert ours[1, :kept].abs().sum(-1).min() > 0 and not ours[1, kept:].any()


def test_latents_are_normalised_per_channel_as_the_pipelines_decode(tiny_wan: Path) -> None:
    cfg = config(wan, tiny_wan)
    enc = wan.load_encoders(model_config=cfg, device=CPU)
    video = frames(2, 5, 32, 48)
    masks = torch.zeros(2, 1, 32, 48)
    masks[..., :, :24] = 1
    media = wan.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video, masks=masks))
    vae = enc.vae
    assert len(set(vae.config.latents_mean)) > 1 and len(set(vae.config.latents_std)) > 1  # the test can see them
    with torch.no_grad():
        raw = vae.encode(video).latent_dist.mode()
    assert media["latents"].shape == (2, 4, 2, 4, 6)  # 5 frames -> 2 latent frames; 32x48 -> 4x6
    # what WanPipeline decodes from: latents / (1 / std) + mean gives back the VAE's latents
    assert torch.allclose(denormalize(media["latents"], vae), raw, atol=1e-5)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    assert torch.allclose(media["latents"], (raw - mean) / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1))
    assert media["mask"].shape == (2, 1, 1, 4, 6)
    assert media["mask"][..., :3].min() == 1 and media["mask"][..., 3:].max() == 0
    image = wan.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video[:, :, 0]))["latents"]
    assert image.shape == (2, 4, 1, 4, 6)  # an image is a one-frame clip


def test_the_16x_vae_of_wan22_crops_to_its_32_pixel_patches(tiny_wan_ti2v: Path, capsys) -> None:
    enc = wan.load_encoders(model_config=config(wan, tiny_wan_ti2v), device=CPU)
    assert enc.multiple == 32
    video = frames(1, 5, 48, 64)  # 48 = an odd multiple of 16: the middle 32 rows are kept
    media = wan.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video, masks=torch.ones(1, 1, 48, 64)))
    with torch.no_grad():
        raw = enc.vae.encode(video[..., 8:40, :]).latent_dist.mode()
    assert media["latents"].shape == (1, 4, 2, 2, 4) and media["mask"].shape == (1, 1, 1, 2, 4)
    assert torch.allclose(denormalize(media["latents"], enc.vae), raw, atol=1e-5)
    told = "64x48 is not a multiple of this model's 32-pixel patches: center-cropped to 64x32"
    assert told in capsys.readouterr().err


@pytest.fixture(scope="module")
def i2v_pipe(tiny_wan_i2v: Path):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(str(tiny_wan_i2v), local_files_only=True)


def test_i2v_conditioning_is_the_pipelines(tiny_wan_i2v: Path, i2v_pipe) -> None:
    cfg = config(wan_i2v, tiny_wan_i2v)
    enc = wan_i2v.load_encoders(model_config=cfg, device=CPU)
    video = frames(2, 9, 32, 48, seed=1)
    first = video[:, :, 0]
    media = wan_i2v.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video, first_frames=first))
    assert sorted(media) == ["first_frame_latents", "image_embeds", "latents"]

    noise = torch.randn(1, 4, 3, 4, 6, generator=torch.Generator().manual_seed(2))
    # the pipeline conditions on one image: each clip's first frame on its own
    condition = torch.cat(
        [i2v_pipe.prepare_latents(f[None], 1, 4, 32, 48, 9, torch.float32, CPU, latents=noise)[1] for f in first]
    )
    assert condition.shape == (2, 4 + 4, 3, 4, 6)  # mask channels (the VAE's 4x time), then the latents
    # equal up to the rounding of a batch of 2 against 2 batches of 1 (the VAE's and CLIP's convolutions)
    torch.testing.assert_close(media["first_frame_latents"], condition[:, 4:].detach(), rtol=1e-5, atol=1e-6)
    images = to_images(first)
    with torch.no_grad():
        embeds = torch.cat([i2v_pipe.encode_image(im, CPU) for im in images])
    torch.testing.assert_close(media["image_embeds"], embeds, rtol=1e-5, atol=1e-6)
    assert media["image_embeds"].shape == (2, 5, 16)

    batch = {**media, "text_embeds": torch.randn(2, 512, 32)}
    (x, t, text, image), (velocity,) = wan_i2v.prepare_inputs(
        batch=batch, context=TrainingContext(cfg), generator=torch.Generator().manual_seed(3)
    )
    assert x.shape == (2, 4 + 4 + 4, 3, 4, 6) and torch.equal(image, media["image_embeds"])
    # the transformer's input is the pipeline's: cat([latents, condition]) along the channels
    torch.testing.assert_close(x[:, 4:], condition.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(x[:, 4:8], condition[:, :4])  # the mask: exactly the pipeline's
    t5 = t.view(-1, 1, 1, 1, 1)
    assert torch.allclose(x[:, :4], (1 - t5) * media["latents"] + t5 * (velocity + media["latents"]), atol=1e-6)


def test_an_i2v_model_needs_first_frames(tiny_wan_i2v: Path) -> None:
    enc = wan_i2v.load_encoders(model_config=config(wan_i2v, tiny_wan_i2v), device=CPU)
    with pytest.raises(ValueError, match=r"wan-i2v encodes video clips with their first frames; got pixels of shape "
                       r"\(1, 3, 32, 32\) and no first frames"):
        wan_i2v.encode_batch(encoders=enc, batch=EncodeBatch(pixels=frames(1, 1, 32, 32)[:, :, 0]))
