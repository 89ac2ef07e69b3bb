"""First-last-frame-to-video (``wan-flf2v``, issue 41): Wan 2.1 FLF2V (CLIP vision of both frames, the image
embedder's two-image ``pos_embed``) and Wan 2.2 I2V A14B given a last frame, against ``WanImageToVideoPipeline`` with
``last_image``: the cached conditioning is its ``prepare_latents`` / ``encode_image([image, last_image])``, the layers
chained are the transformer's forward, samples equal the pipeline's for the same seed (both A14B experts switching at
the boundary), one shared 1-process CLI run trains and its LoRA reproduces the trained model in the pipeline; and
``expert = "both"`` of an I2V A14B folder (``wan-i2v`` and ``wan-flf2v``) gives each sample its own expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from test_wan_encoding import config, frames
from test_wan_sampling import pipeline_latents, sample

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_png
from diffpipe_wan.encoding import to_images
from diffpipe_wan.flf2v import wan_flf2v
from diffpipe_wan.i2v import wan_i2v
from diffpipe_wan.testing import TinyWanConfig, write_clips, write_tiny_wan

CPU = torch.device("cpu")
RANK, ALPHA, STEPS = 4, 8.0, 6


def test_conditioning_is_the_pipelines_with_a_last_image(tiny_wan_flf2v: Path) -> None:
    from diffusers import WanImageToVideoPipeline

    flf2v_pipe = WanImageToVideoPipeline.from_pretrained(str(tiny_wan_flf2v), local_files_only=True)
    cfg = config(wan_flf2v, tiny_wan_flf2v)
    enc = wan_flf2v.load_encoders(model_config=cfg, device=CPU)
    video = frames(2, 9, 32, 48, seed=1)
    first, last = video[:, :, 0], video[:, :, -1]  # the clip's own last frame is the last condition
    media = wan_flf2v.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video, first_frames=first))
    assert sorted(media) == ["first_frame_latents", "image_embeds", "latents"]

    noise = torch.randn(1, 4, 3, 4, 6, generator=torch.Generator().manual_seed(2))
    condition = torch.cat([
        flf2v_pipe.prepare_latents(f[None], 1, 4, 32, 48, 9, torch.float32, CPU, latents=noise, last_image=la[None])[1]
        for f, la in zip(first, last, strict=True)
    ])
    assert condition[:, :4, -1].flatten(1).amax(1).tolist() == [1.0, 1.0]  # the last frame is marked as given
    torch.testing.assert_close(media["first_frame_latents"], condition[:, 4:].detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # one call with both images, as the pipeline encodes them: (2, 5, 16) per sample
        pairs = [flf2v_pipe.encode_image([a, b], CPU) for a, b in zip(to_images(first), to_images(last), strict=True)]
    assert media["image_embeds"].shape == (2, 10, 16)
    torch.testing.assert_close(media["image_embeds"], torch.stack(pairs).flatten(1, 2), rtol=1e-5, atol=1e-6)

    batch = {**media, "text_embeds": torch.randn(2, 512, 32)}
    (x, t, _, image), (velocity,) = wan_flf2v.prepare_inputs(
        batch=batch, context=TrainingContext(cfg), generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(x[:, 4:8], condition[:, :4]) and torch.equal(image, media["image_embeds"])
    torch.testing.assert_close(x[:, 8:], condition[:, 4:].detach(), rtol=1e-5, atol=1e-6)
    t5 = t.view(-1, 1, 1, 1, 1)
    assert torch.allclose(x[:, :4], (1 - t5) * media["latents"] + t5 * (velocity + media["latents"]), atol=1e-6)

    one = video[:, :, :1]
    with pytest.raises(ValueError, match="wan-flf2v encodes clips with a first and a last frame; got clips of 1 frame"):
        wan_flf2v.encode_batch(encoders=enc, batch=EncodeBatch(pixels=one, first_frames=first))


def test_a_last_frame_file_is_the_pipelines_last_image(tiny_wan_flf2v: Path) -> None:
    """``last_frame_path`` (``EncodeBatch.last_frames``, images at their own size): the cached conditioning is what
    ``WanImageToVideoPipeline`` computes with that PIL image as ``last_image`` (resized by its ``video_processor``
    to the clip's size; CLIP sees the image itself)."""
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(str(tiny_wan_flf2v), local_files_only=True)
    cfg = config(wan_flf2v, tiny_wan_flf2v)
    enc = wan_flf2v.load_encoders(model_config=cfg, device=CPU)
    video = frames(2, 9, 32, 48, seed=1)
    first = video[:, :, 0]
    g = torch.Generator().manual_seed(6)
    lasts = [torch.randint(0, 256, (3, h, w), generator=g).float() / 127.5 - 1 for h, w in ((40, 64), (24, 24))]
    media = wan_flf2v.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video, first_frames=first, last_frames=lasts))
    own = wan_flf2v.encode_batch(encoders=enc, batch=EncodeBatch(pixels=video, first_frames=first))
    assert not torch.allclose(media["first_frame_latents"], own["first_frame_latents"])

    noise = torch.randn(1, 4, 3, 4, 6, generator=torch.Generator().manual_seed(2))
    images = [to_images(la[None])[0] for la in lasts]
    condition = torch.cat([
        pipe.prepare_latents(f[None], 1, 4, 32, 48, 9, torch.float32, CPU, latents=noise,
                             last_image=pipe.video_processor.preprocess(im, height=32, width=48))[1]
        for f, im in zip(first, images, strict=True)
    ])
    torch.testing.assert_close(media["first_frame_latents"], condition[:, 4:].detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        pairs = [pipe.encode_image([a, b], CPU) for a, b in zip(to_images(first), images, strict=True)]
    torch.testing.assert_close(media["image_embeds"], torch.stack(pairs).flatten(1, 2), rtol=1e-5, atol=1e-6)


def test_layers_compute_the_flf2v_transformer(tiny_wan_flf2v: Path) -> None:
    from test_wan_loading import run_layers

    cfg = config(wan_flf2v, tiny_wan_flf2v)
    model = wan_flf2v.load_diffusion_model(cfg, CPU, torch.float32)
    assert model.condition_embedder.image_embedder.pos_embed.abs().sum() > 0
    g = torch.Generator().manual_seed(0)
    x, t, text = torch.randn(2, 12, 3, 4, 6, generator=g), torch.rand(2, generator=g), torch.randn(2, 512, 32)
    image = torch.randn(2, 10, 16, generator=g)  # each sample's first and last frame's CLIP tokens
    with torch.no_grad():
        want = model(x, t * 1000, text, encoder_hidden_states_image=image.reshape(4, 5, 16)).sample
        assert torch.equal(run_layers(wan_flf2v, model, cfg, (x, t, text, image)), want)
        swapped = torch.cat([image[:, 5:], image[:, :5]], dim=1)  # the order of the two frames matters
        assert not torch.allclose(run_layers(wan_flf2v, model, cfg, (x, t, text, swapped)), want)


def test_a_wan21_i2v_transformer_is_not_first_last_frame(tiny_wan_i2v: Path, tiny_wan_flf2v: Path) -> None:
    (problem,) = wan_flf2v.validate_model_files(config(wan_flf2v, tiny_wan_i2v))
    assert "takes one image" in problem and 'type = "wan-i2v"' in problem and str(tiny_wan_i2v) in problem
    assert wan_flf2v.validate_model_files(config(wan_flf2v, tiny_wan_flf2v)) == []


@pytest.mark.parametrize("plugin", [wan_i2v, wan_flf2v], ids=lambda p: p.spec.name)
def test_an_i2v_a14b_trains_both_experts_each_sample_its_own(tiny_wan_a14b_i2v: Path, plugin) -> None:
    cfg = config(plugin, tiny_wan_a14b_i2v, text_max_length=8)
    assert cfg.expert is None and plugin.validate_model_files(cfg) == []  # "both" by default
    model = plugin.load_diffusion_model(cfg, CPU, torch.float32)
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randn(6, 4, 2, 4, 4, generator=g) for k in ("latents", "first_frame_latents")}
    batch["text_embeds"] = torch.randn(6, 8, 32, generator=g)
    inputs, _ = plugin.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(4))
    x, t, text, expert = inputs
    assert torch.equal(expert, (t < 0.9).long()) and 0 < int(expert.sum()) < 6, t  # both experts in the batch
    assert x[:, 7, -1].amax() == (1.0 if plugin is wan_flf2v else 0.0)  # the last pixel frame's mask channel
    out = inputs
    for layer in plugin.split_into_layers(model, cfg):
        out = layer(out)
    for i in range(6):
        single = model if expert[i] == 0 else model.transformer_2
        want = single(x[i : i + 1], t[i : i + 1] * 1000, text[i : i + 1], return_dict=False)[0]
        torch.testing.assert_close(out[0][i : i + 1], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fixture", ["tiny_wan_flf2v", "tiny_wan_a14b_i2v"])
def test_samples_equal_the_pipeline_with_a_last_image(request, tmp_path: Path, fixture: str) -> None:
    from diffusers import WanImageToVideoPipeline

    folder = request.getfixturevalue(fixture)
    first, last = (write_png(tmp_path / f"{n}.png", 60, 40, seed=s) for n, s in (("first", 4), ("last", 8)))
    table = {"type": "wan-flf2v", "path": folder, "dtype": "float32", "encoder_dtype": "float32"}
    cfg = validate(wan_flf2v.spec.config_schema, {**table, "sample_image": first, "sample_last_image": last}, "t")
    ours, texts, _ = sample(wan_flf2v, cfg, 2.0)
    pipe = WanImageToVideoPipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    images = {k: Image.open(f).convert("RGB") for k, f in (("image", first), ("last_image", last))}
    expected = pipeline_latents(pipe, texts, 2.0, **images)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    other_last = pipeline_latents(pipe, texts, 2.0, image=images["image"], last_image=images["image"])
    assert (other_last - expected).abs().max() > 1e-3  # the last frame matters

    no_last = validate(wan_flf2v.spec.config_schema, {**table, "sample_image": first}, "t")
    from diffpipe_core.sampling.loop import noise_generator
    from diffpipe_core.types import SampleRequest

    with pytest.raises(ValueError, match="set \\[model\\] sample_last_image to an image file"):
        wan_flf2v.denoise_init(SampleRequest(width=48, height=32, frames=5), no_last, noise_generator(5, 0))


@pytest.fixture(scope="module")
def flf2v_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared ``wan-flf2v`` run: the tiny Wan 2.1 FLF2V, 4 clips of 5 frames, each with its last frame from a file
    of its own (``last_frame_path``, 48x32 images), LoRA, 1 stage in 1 process."""
    root = tmp_path_factory.mktemp("wan-flf2v")
    write_tiny_wan(root / "model", TinyWanConfig(i2v=True, clip=True, flf2v=True))
    clips = write_clips(root / "media", ["a red car moving", "a river in a city", "a dog running", "a bright sky"], 5,
                        (32, 32))
    (root / "last").mkdir()
    for i, clip in enumerate(clips):
        write_png(root / "last" / f"{clip.stem}.png", 48, 32, seed=40 + i)
    write_dataset_toml(root / "dataset.toml", root / "media", {"last_frame_path": str(root / "last")},
                       resolutions=[32], enable_ar_bucket=False, frame_buckets=[5])
    model = {"type": "wan-flf2v", "path": "model", "dtype": "float32", "encoder_dtype": "float32"}
    top = {"max_steps": STEPS, "micro_batch_size_per_gpu": 2, "pipeline_stages": 1, "seed": 3}
    (root / "run.toml").write_text(runs.lora_run_toml(model, 1e-2, None, RANK, ALPHA, **top))
    return runs.train(root, root / "run.toml", procs=1, timeout=600, OMP_NUM_THREADS="1")


@pytest.mark.slow
def test_flf2v_trains_and_its_lora_reproduces_in_the_pipeline(flf2v_run: Path) -> None:
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    from diffpipe_core.adapters import read_adapter
    from diffpipe_core.data.cache_store import list_shards

    assert len(runs.losses(flf2v_run)) == STEPS
    cache = flf2v_run.parent.parent / "cache"
    shapes = {shard.columns["image_embeds"][0] for media in cache.rglob("media") for shard in list_shards(media)}
    assert shapes == {(10, 16)}, shapes  # both frames' CLIP tokens cached with each clip
    assert_cached_with_last_frame_files(flf2v_run.parent.parent)
    model = flf2v_run.parent.parent / "model"
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 12, 2, 4, 4, generator=g),  # noisy latents, 4 mask channels, condition
        "timestep": torch.rand(2, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(2, 512, 32, generator=g),
        "encoder_hidden_states_image": torch.randn(4, 5, 16, generator=g),  # first, last, first, last
    }
    _, adapter = read_adapter(flf2v_run / "saved" / "final")
    fresh = WanTransformer3DModel.from_pretrained(str(model / "transformer"))
    reference = runs.with_trained_lora(fresh, flf2v_run, RANK, ALPHA, adapter["target_modules"])
    pipe = WanImageToVideoPipeline.from_pretrained(str(model), local_files_only=True)
    runs.assert_lora_reproduces(pipe, flf2v_run / "saved" / "final" / "adapter_model.safetensors", reference, inputs)


def assert_cached_with_last_frame_files(root: Path) -> None:
    """Each clip's cached conditioning is ``encode_batch`` of the clip with its ``last_frame_path`` image."""
    from diffpipe_core.config import load_config
    from diffpipe_core.data.cache import open_cached
    from diffpipe_core.data.dataset_config import load_dataset_config
    from diffpipe_core.data.decode import load_media
    from diffpipe_core.data.scan import scan_dataset
    from diffpipe_core.registry import get_registry
    from diffpipe_core.testing.cache import rows_by_id

    run = load_config(root / "run.toml", get_registry())
    cfg = run.model
    rows = rows_by_id(open_cached(run.run.dataset, get_registry().model("wan-flf2v"), cfg))
    items = scan_dataset(load_dataset_config(root / "dataset.toml"), wan_flf2v.spec, progress=False).items
    assert len(rows) == len(items) == 4 and all(i.paired[0].path.parent == root / "last" for i in items)
    decoded = [load_media(item, wan_flf2v.spec) for item in items]
    pixels = torch.stack([d.pixels for d in decoded])
    batch = EncodeBatch(pixels=pixels, first_frames=pixels[:, :, 0], last_frames=[d.paired["last_frame"][0]
                                                                                  for d in decoded])
    want = wan_flf2v.encode_batch(encoders=wan_flf2v.load_encoders(model_config=cfg, device=CPU), batch=batch)
    for j, item in enumerate(items):
        torch.testing.assert_close(rows[item.id]["first_frame_latents"], want["first_frame_latents"][j], rtol=1e-5,
                                   atol=1e-5)
