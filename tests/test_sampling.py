"""Samples during training and ``diffpipe sample`` with the reference plugin (issue 14).

One 2-stage run with ``[sample]`` (classifier-free guidance, a prompt file, an observer plugin recording which
modules exist) serves: the files at the expected steps and in TensorBoard (1), the pipeline sample equal to
the model run directly (2), the training losses equal to the shared sampling-off run (5), the VAE and text
encoders not resident while training (6), and, with one ``diffpipe sample`` run of the saved adapter on 2
processes, the same seed giving identical images across two runs (1). A tiny video plugin writes an MP4 (4).
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import load_file
from test_train import make_project, run_dirs, train

import diffpipe_reference.plugin as reference
from diffpipe_core import ModelSpec, hookimpl
from diffpipe_core.cli import main as cli
from diffpipe_core.config import load_config
from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.registry import Registry, get_registry
from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import write_samples
from diffpipe_core.sampling.schedules import flow_euler_step
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.processes import cli_env, run_diffpipe, write_plugin_distribution
from diffpipe_core.types import SampleRequest
from diffpipe_reference.model import TinyDiT, read_config, write_tiny_model

PROMPTS = ["a red cat", "a blue dog"]
SAMPLE_TABLE = """
[sample]
prompts = "prompts.txt"
negative_prompt = "blurry"
before_first_step = true
every_n_steps = 4
steps = 4
cfg = 2.0
seed = 3
resolution = 64
"""

# A generic plugin (entry point group diffpipe.plugins) that records which modules are alive in the training
# process after every step, and while the core decodes samples (a wrapper sees the model plugin's hook call).
OBSERVER = """
import gc
import json

import torch
from diffpipe_core import hookimpl

LOG = {log!r}


def _modules():
    return sorted({{type(o).__name__ for o in gc.get_objects() if isinstance(o, torch.nn.Module)}})


def _write(record):
    with open(LOG, "a") as f:
        f.write(json.dumps(record) + "\\n")


@hookimpl
def on_train_step_end(step, metrics):
    _write({{"when": "step", "step": step, "modules": _modules()}})


@hookimpl(wrapper=True)
def decode_latents(decoder, latents):
    _write({{"when": "decode", "modules": _modules()}})
    return (yield)
"""


@pytest.fixture(scope="module")
def sampling_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared reference 2-stage run (same seed and data) with [sample] on and the module observer."""
    root = tmp_path_factory.mktemp("sampling")
    log = root / "modules.jsonl"
    site = write_plugin_distribution(
        root / "site",
        "diffpipe-module-observer",
        {"diffpipe.plugins": {"module-observer": "module_observer"}},
        {"module_observer": OBSERVER.format(log=str(log))},
    )
    config = make_project(root, stages=2, max_steps=12, ckpt=3, extra='save_dtype = "float32"\n', tables=SAMPLE_TABLE)
    (root / "prompts.txt").write_text("# sample prompts\n" + "\n".join(PROMPTS) + "\n\n")
    train(root, config, "--num-procs", "2", env=cli_env([site]))
    return run_dirs(root)[0]


def _image(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.mode == "RGB" and im.size == (64, 64), (path, im.mode, im.size)
        return np.asarray(im)


@pytest.mark.slow
def test_samples_are_written_at_the_configured_steps(sampling_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = sorted(p.name for p in (sampling_run / "samples").iterdir())
    assert folders == ["step-0000000", "step-0000004", "step-0000008", "step-0000012"]
    for name in folders:
        files = sorted(p.name for p in (sampling_run / "samples" / name).iterdir())
        assert files == ["00-a-red-cat.png", "01-a-blue-dog.png", "latents.safetensors", "prompts.json"], files
        info = json.loads((sampling_run / "samples" / name / "prompts.json").read_text())
        assert info["prompts"] == PROMPTS and info["cfg"] == 2.0 and info["steps"] == 4 and info["seed"] == 3
    first, last = (_image(sampling_run / "samples" / f / "00-a-red-cat.png") for f in (folders[0], folders[-1]))
    assert np.abs(first.astype(int) - last.astype(int)).max() > 0, "training did not change the sample"
    events = EventAccumulator(str(sampling_run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert {"samples/00", "samples/01"} <= set(events.Tags()["images"])
    assert [e.step for e in events.Images("samples/01")] == [0, 4, 8, 12]


@pytest.mark.slow
def test_sampling_leaves_the_training_losses_unchanged(sampling_run: Path, reference_two_stages: Path) -> None:
    with_samples, without = train_losses(sampling_run), train_losses(reference_two_stages)
    assert sorted(with_samples) == list(range(1, 13))
    assert with_samples == without  # bit for bit: same seed, sampling draws from its own generators


@pytest.mark.slow
def test_pipeline_sample_equals_the_model_run_directly(sampling_run: Path) -> None:
    """Step 0 (LoRA B = 0, so the base model): the 2-stage pipeline sample vs TinyDiT.forward in this process,
    with the same prompts, noise, CFG and steps; the trained step-12 sample is clearly different."""
    model_dir = sampling_run.parent.parent / "model"
    plugin = get_registry().model("reference")
    cfg = load_config(sampling_run.parent.parent / "run.toml", get_registry())
    texts = encode_prompts(plugin, cfg.model, PROMPTS, "blurry", torch.device("cpu"))
    model = TinyDiT(read_config(model_dir))
    model.load_state_dict(load_file(str(model_dir / "transformer.safetensors")))
    model.eval()

    def direct(inputs):
        with torch.no_grad():
            return [model(*x) for x in inputs]

    request = SampleRequest(width=64, height=64, steps=4)
    expected = generate(plugin, cfg.model, request, texts, [noise_generator(3, i) for i in range(2)], direct, cfg=2.0)
    step0 = load_file(str(sampling_run / "samples" / "step-0000000" / "latents.safetensors"))
    step12 = load_file(str(sampling_run / "samples" / "step-0000012" / "latents.safetensors"))
    for i, want in enumerate(expected):
        got = step0[f"sample_{i:02d}"]
        assert got.shape == (1, 4, 8, 8)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (step12[f"sample_{i:02d}"] - want).abs().max() > 100 * (got - want).abs().max()


@pytest.mark.slow
def test_vae_and_text_encoders_are_not_resident_while_training(sampling_run: Path) -> None:
    records = [json.loads(line) for line in (sampling_run.parent.parent / "modules.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["when"] == "step"]
    decodes = [r for r in records if r["when"] == "decode"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert len(decodes) == 4 * len(PROMPTS)  # every sampling point decodes each prompt
    assert all("TinyVAE" in r["modules"] for r in decodes)  # the observer sees the decoder when it exists
    for r in steps:
        assert "TinyDiT" in r["modules"], r
        assert "TinyVAE" not in r["modules"] and "ByteTextEncoder" not in r["modules"], r


@pytest.mark.slow
def test_diffpipe_sample_repeats_the_training_sample(sampling_run: Path) -> None:
    """The saved final adapter, sampled by ``diffpipe sample`` on 2 processes (2 stages), gives the very image
    the run wrote after its last step: same seed, prompt, CFG, steps."""
    root = sampling_run.parent.parent
    out = root / "cli-sample.png"
    result = run_diffpipe(
        ["sample", "--config", "run.toml", "--adapter", str(sampling_run / "saved" / "final"), "--prompt",
         PROMPTS[0], "--out", str(out), "--num-procs", "2"],
        cwd=root,
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.output[-4000:]
    assert f"wrote {out}" in result.stdout
    assert np.array_equal(_image(out), _image(sampling_run / "samples" / "step-0000012" / "00-a-red-cat.png"))
    base = _image(sampling_run / "samples" / "step-0000000" / "00-a-red-cat.png")
    assert not np.array_equal(_image(out), base)  # the adapter was applied


def test_sample_table_errors_name_the_key(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "model")
    (tmp_path / "dataset.toml").write_text('[[directory]]\npath = "."\n')
    table = '[sample]\nprompts = "missing.txt"\nresolution = [64, 40]\nframes = 5\n'
    (tmp_path / "run.toml").write_text(
        f'output_dir = "out"\ndataset = "dataset.toml"\n[model]\ntype = "reference"\npath = "model"\n{table}'
    )
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "run.toml", get_registry())
    text = "\n".join(exc.value.problems)
    assert "sample: say when to sample" in text
    assert "sample.resolution: height 40 is not a multiple of 16" in text and "use e.g. 32 or 48" in text
    assert "sample.frames: 5, but model 'reference' makes images" in text
    assert f"sample.prompts: file not found: {tmp_path / 'missing.txt'}" in text


class NoSamplingPlugin:
    """A model plugin without the denoising hooks."""

    @hookimpl
    def model_spec(self):
        return ModelSpec(name="nosample", modality="image", config_schema=reference.ReferenceConfig)


def test_sample_table_for_a_plugin_that_cannot_sample(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "model")
    (tmp_path / "dataset.toml").write_text('[[directory]]\npath = "."\n')
    (tmp_path / "run.toml").write_text(
        'output_dir = "out"\ndataset = "dataset.toml"\n[model]\ntype = "nosample"\npath = "model"\n'
        '[sample]\nprompts = ["a"]\nevery_n_steps = 5\n'
    )
    registry = Registry()
    registry.register_model("nosample", NoSamplingPlugin())
    with pytest.raises(ConfigError, match="model plugin 'nosample' cannot sample .*denoise_init, denoise_inputs"):
        load_config(tmp_path / "run.toml", registry)


def test_models_lists_which_plugins_can_sample() -> None:
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    column = header.split().index("sample")
    reference_row = next(r for r in rows if r.startswith("reference "))
    assert reference_row.split()[column] == "yes"


# ----------------------------------------------------------------------------- 4. a video plugin writes an MP4
VIDEO_SPEC = ModelSpec(
    name="tinyvideo-sampler",
    modality="video",
    config_schema=reference.ReferenceConfig,
    spatial_multiple=16,
    frame_multiple=4,
    frame_offset=1,
    video_fps=8,
)


class TinyVideoSampler:
    """The reference model on videos: latents ``(1, C, F, h, w)``, the frames stacked along the height for the
    DiT, each frame decoded by the reference VAE."""

    load_encoders = staticmethod(reference.load_encoders)
    encode_batch = staticmethod(reference.encode_batch)
    load_diffusion_model = staticmethod(reference.load_diffusion_model)
    split_into_layers = staticmethod(reference.split_into_layers)
    load_decoder = staticmethod(reference.load_decoder)

    @hookimpl
    def model_spec(self):
        return VIDEO_SPEC

    @hookimpl
    def denoise_init(self, request, model_config, generator):
        image, schedule = reference.denoise_init(request, model_config, generator)
        video = torch.randn((1, image.shape[1], request.frames, *image.shape[2:]), generator=generator)
        return video, schedule

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        b, c, f, h, w = latents.shape
        stacked = latents.reshape(b, c, f * h, w)
        return reference.denoise_inputs(stacked, schedule, index, text, request, model_config)

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        return flow_euler_step(latents, prediction.reshape(latents.shape), schedule, index)

    @hookimpl
    def decode_latents(self, decoder, latents):
        b, c, f, h, w = latents.shape
        frames = decoder.decode(latents.transpose(1, 2).reshape(b * f, c, h, w))
        return frames.reshape(b, f, *frames.shape[1:]).transpose(1, 2)


def test_a_video_plugin_writes_a_playable_mp4(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    write_tiny_model(tmp_path / "model")
    registry = Registry()
    registry.register_model("tinyvideo-sampler", TinyVideoSampler())
    plugin = registry.model("tinyvideo-sampler")
    cfg = reference.ReferenceConfig(type="tinyvideo-sampler", path=tmp_path / "model")
    texts = encode_prompts(plugin, cfg, ["a red cat"], None, torch.device("cpu"))
    model = plugin.require("load_diffusion_model", model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)
    forward = LayerChainForward(plugin.require("split_into_layers", model=model, model_config=cfg))
    request = SampleRequest(width=64, height=48, frames=9, steps=2)
    latents = generate(plugin, cfg, request, texts, [noise_generator(0, 0)], forward)
    writer = SummaryWriter(str(tmp_path / "tb"))
    (path,) = write_samples(
        plugin, cfg, {0: latents[0]}, ["a red cat"], request, tmp_path / "out", torch.device("cpu"), 8.0,
        step=5, writer=writer,
    )  # fmt: skip
    writer.close()
    assert path == tmp_path / "out" / "00-a-red-cat.mp4"
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert float(stream.average_rate) == 8.0
    assert len(frames) == 9 and frames[0].shape == (48, 64, 3)
    assert json.loads((tmp_path / "out" / "prompts.json").read_text())["frames"] == 9
