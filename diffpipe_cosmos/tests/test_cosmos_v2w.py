"""Video-to-world (``[model] conditioning = "video"``) in-process, on tiny video-to-world models, against
``CosmosVideoToWorldPipeline`` (1.0) and ``Cosmos2VideoToWorldPipeline`` (Predict2):

- the key is validated; a text-to-world transformer is refused for it;
- training's conditioning (the clip's first latent frames, the indicator and the mask channel, Predict2's
  conditioning timestep) is the pipelines' ``prepare_latents`` for the clip's first frames, and the loss covers the
  generated frames only;
- the sample conditioning from ``[model] sample_video`` is ``prepare_latents``'s, drawn from the same generator;
- the layers chained equal the transformer's forward on conditioned inputs;
- samples (with and without CFG) equal the pipelines' latents for the same seed, decoded and written as MP4;
- the conformance kit passes with the option set (sampling from a ``sample_video``).
(Training through the CLI: test_cosmos_v2w_train.py.)
"""

from __future__ import annotations

import functools
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from cosmos_common import PLUGINS, config
from test_cosmos_sampling import FPS, HEIGHT, NEGATIVE, PROMPT, SEED, STEPS, WIDTH, NoGuardrail

from diffpipe_core import TrainingContext
from diffpipe_core.registry import get_registry
from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.output import to_uint8, write_sample
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.media import write_video
from diffpipe_core.types import EncodeBatch, SampleRequest
from diffpipe_cosmos import resize, video2world

NAMES = ["cosmos", "cosmos-predict2"]
TEMPORAL = {"cosmos": 8, "cosmos-predict2": 4}
# (pixel frames, conditioning latent frames): 1.0 3 latent frames, 2 conditioning; Predict2 3 latent frames, 2
CLIP = {"cosmos": (17, 2), "cosmos-predict2": (9, 2)}
PIPELINES = {"cosmos": "CosmosVideoToWorldPipeline", "cosmos-predict2": "Cosmos2VideoToWorldPipeline"}


def v2w_config(name: str, folder: Path, **kw):
    return config(name, folder, conditioning="video", **kw)


@functools.cache
def pipeline(name: str, folder: Path):
    import diffusers
    from transformers import AutoTokenizer

    resize.install()
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    cls = getattr(diffusers, PIPELINES[name])
    return cls.from_pretrained(str(folder), safety_checker=NoGuardrail(), tokenizer=tokenizer, dtype=torch.float32)


def test_conditioning_key_is_validated(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"conditioning.*'text'.*'video'"):
        config("cosmos-predict2", tiny_models["cosmos-predict2"], conditioning="image")


@pytest.mark.parametrize("name", NAMES)
def test_video_conditioning_needs_a_video_to_world_transformer(
    tiny_models: dict[str, Path], tiny_v2w: dict[str, Path], name: str, tmp_path: Path
) -> None:
    plugin = PLUGINS[name]
    (problem,) = plugin.validate_model_files(v2w_config(name, tiny_models[name]))
    assert "conditioning" in problem and "in_channels = out_channels + 1" in problem
    assert "in_channels 4, out_channels 4" in problem
    assert plugin.validate_model_files(v2w_config(name, tiny_v2w[name])) == []
    missing = tmp_path / "missing.mp4"
    assert plugin.validate_model_files(v2w_config(name, tiny_v2w[name], sample_video=missing)) == [
        f"[model] sample_video: file not found: {missing}"
    ]
    # text-to-world stays the default, on either transformer
    assert config(name, tiny_v2w[name]).conditioning == "text"


def clip(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(1, 3, frames, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(seed)) * 2 - 1


class ModeOf:
    """The pipeline's VAE with its posterior at the mode: training latents are the posterior's mode (the cache's,
    as NVIDIA's trainers encode); the pipelines draw a sample (the sampling tests below compare that)."""

    def __init__(self, vae) -> None:
        self.vae = vae

    def __getattr__(self, name: str):
        return getattr(self.vae, name)

    def encode(self, x):
        from diffusers.models.autoencoders.vae import IdentityDistribution

        out = self.vae.encode(x)
        out.latent_dist = IdentityDistribution(out.latent_dist.mode())
        return out


@pytest.mark.parametrize("name", NAMES)
def test_training_conditioning_is_the_pipelines(tiny_v2w: dict[str, Path], name: str) -> None:
    folder, (frames, n) = tiny_v2w[name], CLIP[name]
    # 1.0 without augment noise, so that its conditioning frames' input is exactly x_0 * c_in(0) = x_0 / sigma_data
    extra = {"augment_sigma": 0.0} if name == "cosmos" else {}
    cfg = v2w_config(name, folder, conditioning_frames=n, **extra)
    plugin, pixels = PLUGINS[name], clip(frames)
    encoders = plugin.load_encoders(cfg, torch.device("cpu"))
    latents = plugin.encode_batch(encoders, EncodeBatch(pixels=pixels))["latents"]

    pipe = pipeline(name, folder)
    cond_pixels = pixels[:, :, : 1 + TEMPORAL[name] * (n - 1)]
    vae, pipe.vae = pipe.vae, ModeOf(pipe.vae)
    try:
        with torch.no_grad():
            _, init, indicator, _, mask, _ = prepare_latents(pipe, name, cond_pixels, frames, None)
    finally:
        pipe.vae = vae
    assert indicator.flatten().tolist() == [1.0] * n + [0.0] * (latents.shape[2] - n)
    torch.testing.assert_close(latents[:, :, :n], init[:, :, :n], rtol=1e-4, atol=1e-5)

    batch = {"latents": latents, "t5_embeds": torch.zeros(1, 16, 16)}
    (x, timestep, _), targets = plugin.prepare_inputs(batch, TrainingContext(cfg), torch.Generator().manual_seed(1))
    assert x.shape[1] == 5 and torch.equal(x[:, 4:], mask)  # the condition mask: the transformer's last channel
    scale = 0.5 if name == "cosmos" else 1.0  # 1.0: x_0 * c_in(augment_sigma = 0) = x_0 / sigma_data
    torch.testing.assert_close(x[:, :4, :n] * scale, init[:, :, :n], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(x[:, :4, n:], latents[:, :, n:] / scale)  # the generated frames are noised
    if name == "cosmos-predict2":  # the conditioning frames at t = sigma_conditioning / (1 + sigma_conditioning)
        assert timestep.shape == (1, 1, 3, 1, 1)
        torch.testing.assert_close(timestep[0, 0, :n].flatten(), torch.full((n,), 1e-4 / (1 + 1e-4)))
    # the loss covers the generated frames only: a prediction wrong only on the conditioning frames costs nothing
    out = torch.randn(1, 4, *latents.shape[2:], generator=torch.Generator().manual_seed(2))
    worse = out.clone()
    worse[:, :, :n] += 100
    assert plugin.compute_loss((worse,), targets) == plugin.compute_loss((out,), targets)
    worse[:, :, n:] += 1
    assert plugin.compute_loss((worse,), targets) != plugin.compute_loss((out,), targets)


def sample_video(folder: Path, frames: int) -> Path:
    file = folder.parent / f"condition_{frames}.mp4"
    return file if file.is_file() else write_video(file, frames, fps=16, size=(WIDTH, HEIGHT), seed=7)


def prepare_latents(pipe, name: str, pixels: torch.Tensor, frames: int, generator: torch.Generator | None):
    """The video-to-world pipeline's ``prepare_latents`` for one 4-channel, ``frames``-frame video conditioned on
    ``pixels`` (1.0 takes one more flag, ``do_classifier_free_guidance``, than Predict2)."""
    flags = [False, False] if name == "cosmos" else [False]
    return pipe.prepare_latents(
        pixels, 1, 4, HEIGHT, WIDTH, frames, *flags, torch.float32, torch.device("cpu"), generator
    )


@pytest.mark.parametrize("name", NAMES)
def test_sample_conditioning_is_prepare_latents(tiny_v2w: dict[str, Path], name: str) -> None:
    folder, (frames, n) = tiny_v2w[name], CLIP[name]
    video = sample_video(folder, 1 + TEMPORAL[name] * (n - 1))
    cfg = v2w_config(name, folder, conditioning_frames=n, sample_video=video)
    request = SampleRequest(width=WIDTH, height=HEIGHT, frames=frames, steps=STEPS)
    ours = PLUGINS[name].sample_condition(cfg, request, torch.Generator().manual_seed(3))

    pipe = pipeline(name, folder)
    pixels = pipe.video_processor.preprocess_video(video2world.read_frames(video, 99), HEIGHT, WIDTH)
    with torch.no_grad():
        _, init, indicator, _, _, _ = prepare_latents(pipe, name, pixels, frames, torch.Generator().manual_seed(3))
    assert pixels.shape[2] == 1 + TEMPORAL[name] * (n - 1)
    torch.testing.assert_close(ours.latents, init, rtol=1e-4, atol=1e-5)
    assert torch.equal(ours.cond, indicator)


@pytest.mark.parametrize("name", NAMES)
def test_layers_chained_equal_the_forward_on_conditioned_inputs(tiny_v2w: dict[str, Path], name: str) -> None:
    from test_cosmos_v2w_train import conditioned_inputs

    resize.install()
    cfg, plugin = v2w_config(name, tiny_v2w[name], fps=16), PLUGINS[name]
    model = plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    inputs = conditioned_inputs(name)
    with torch.no_grad():
        want = model(**inputs, return_dict=False)[0]
        x = torch.cat([inputs["hidden_states"], inputs["condition_mask"]], dim=1)
        text = inputs["encoder_hidden_states"]
        got = LayerChainForward(plugin.split_into_layers(model, cfg))([(x, inputs["timestep"], text)])
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


@functools.cache
def pipeline_v2w_latents(
    name: str, folder: Path, video: Path, frames: int, cfg: float, n: int = 1, augment: float | None = None
) -> torch.Tensor:
    """The video-to-world pipeline's final latents for ``video``'s first ``n`` conditioning latent frames, from the
    plugin's prompt embeddings and the sampler's seed (1.0: at ``augment_sigma`` ``augment``, else its default)."""
    pipe = pipeline(name, folder)
    texts = prompt_texts(name, folder)
    kwargs = {"negative_prompt_embeds": texts.uncond["t5_embeds"]} if cfg > 1 else {}
    if augment is not None:
        kwargs["augment_sigma"] = augment
    return pipe(
        video=video2world.read_frames(video, 1 + TEMPORAL[name] * (n - 1)),
        prompt_embeds=texts.cond["t5_embeds"],
        guidance_scale=cfg - 1 if cfg > 1 else 1.0,
        num_frames=frames,
        height=HEIGHT,
        width=WIDTH,
        fps=FPS[name],
        num_inference_steps=STEPS,
        generator=noise_generator(SEED, 0),
        output_type="latent",
        **kwargs,
    ).frames


@functools.cache
def prompt_texts(name: str, folder: Path):
    (texts,) = encode_prompts(get_registry().model(name), config(name, folder), [PROMPT], NEGATIVE, torch.device("cpu"))
    return texts


# (pixel frames, conditioning latent frames, [sample] cfg, 1.0's augment_sigma): 2 conditioning latent frames with
# guidance (1 without: the cosmos-predict2 run's sample, test_cosmos_v2w_train.py); 1.0 at a large augment_sigma, so
# that its augment noise (drawn per step, the positive prompt's first) matters at this tolerance, and at the last of
# the 3 noise levels, below it, the frames are not replaced
SAMPLES = {"cosmos": [(17, 2, 3.5, 0.5)], "cosmos-predict2": [(9, 2, 3.5, None)]}


@pytest.mark.parametrize("name", NAMES)
def test_v2w_samples_equal_the_pipeline(tiny_v2w: dict[str, Path], name: str, tmp_path: Path) -> None:
    import av

    folder, plugin = tiny_v2w[name], get_registry().model(name)
    texts = prompt_texts(name, folder)
    for frames, n, cfg_scale, aug in SAMPLES[name]:
        video = sample_video(folder, 1 + TEMPORAL[name] * (n - 1))
        extra = {} if aug is None else {"augment_sigma": aug}
        cfg = v2w_config(name, folder, conditioning_frames=n, sample_video=video, **extra)
        model = plugin.require(
            "load_diffusion_model", model_config=cfg, device=torch.device("cpu"), dtype=torch.float32
        )
        forward = LayerChainForward(plugin.require("split_into_layers", model=model, model_config=cfg))
        request = SampleRequest(width=WIDTH, height=HEIGHT, frames=frames, steps=STEPS)
        (ours,) = generate(plugin, cfg, request, [texts], [noise_generator(SEED, 0)], forward, cfg=cfg_scale)
        want = pipeline_v2w_latents(name, folder, video, frames, cfg_scale, n, aug)
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
        assert ours.abs().max() < 20, "the latents were not denoised from sigma_max = 80"
    assert not PLUGINS[name]._sampling  # every sample's conditioning released after its last step

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    assert pixels.shape == (3, frames, HEIGHT, WIDTH)
    file = write_sample(tmp_path / "sample", to_uint8(pixels), float(plugin.spec.video_fps))
    with av.open(str(file)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == Fraction(FPS[name])
        assert len(list(container.decode(stream))) == frames


@pytest.mark.parametrize("name", NAMES)
def test_v2w_plugins_conform(tiny_v2w: dict[str, Path], name: str) -> None:
    folder = tiny_v2w[name]
    frames = 9
    table = {"type": name, "path": folder, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 16}
    table |= {"conditioning": "video", "sample_video": sample_video(folder, 1)}
    pixels = torch.rand(2, 3, frames, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(PLUGINS[name], name, table, pixels=pixels, captions=["a red cat", "a robot arm walking"])
