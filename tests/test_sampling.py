"""Samples during training and ``diffpipe sample`` with the reference plugin (issues 14 and 21).

One 2-stage run with ``[sample]`` (classifier-free guidance, a prompt file, no resolution: the dataset's 64 px,
an observer plugin recording which modules exist) serves: the files and the contact sheet at the expected steps,
in TensorBoard and named by one line each (1), the sampler's forwards through the pipeline engine equal to the
same sampler with the model run directly (2; the plugins' comparisons with diffusers prove the sampler itself), the
training losses equal to the shared sampling-off run (5), the decoder loaded once on rank 0 and the text encoders
not resident while training (6), and, with ``diffpipe sample`` runs of the saved adapter (2 processes with the
dataset folder gone; 1 process with an empty one and a [sample] table that never says when), the same seed giving
identical images across runs without the dataset being read. A tiny video plugin writes an MP4 (4).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
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
from diffpipe_core.sampling.config import SampleConfig, dataset_shape, sample_shape
from diffpipe_core.sampling.contact_sheet import cell_size, contact_sheet, sheet_layout
from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import sample_request, write_samples
from diffpipe_core.sampling.schedules import flow_euler_step
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.media import write_dataset_toml
from diffpipe_core.testing.processes import cli_env, run_diffpipe, write_plugin_distribution
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_core.types import SampleRequest
from diffpipe_reference.model import TinyDiT, read_config, write_tiny_model
from diffpipe_reference.variants import ReferenceSampling

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
"""

# A generic plugin (entry point group diffpipe.plugins) that records which modules are alive in the training
# process after every step, and while the core decodes samples (a wrapper sees the model plugin's hook call).
OBSERVER = """
import gc
import json
import os

import torch
from diffpipe_core import hookimpl

LOG = {log!r}


def _modules():
    return sorted({{type(o).__name__ for o in gc.get_objects() if isinstance(o, torch.nn.Module)}})


def _write(record):
    with open(LOG, "a") as f:
        f.write(json.dumps(record) + "\\n")


def _decoder_devices():
    return sorted({{str(p.device) for o in gc.get_objects() if type(o).__name__ == "TinyVAE" for p in o.parameters()}})


@hookimpl
def on_train_step_end(step, metrics):
    _write({{"when": "step", "step": step, "modules": _modules(), "decoder_devices": _decoder_devices()}})


@hookimpl(wrapper=True)
def load_decoder(model_config, device):
    _write({{"when": "load_decoder", "rank": os.environ.get("RANK"), "device": str(device)}})
    return (yield)


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
    (root / "train.log").write_text(train(root, config, "--num-procs", "2", env=cli_env([site])))
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
        folder = sampling_run / "samples" / name
        files = sorted(p.name for p in folder.iterdir())
        assert files == [
            "00-a-red-cat.png", "01-a-blue-dog.png", "contact-sheet.png", "latents.safetensors", "prompts.json"
        ], files  # fmt: skip
        info = json.loads((folder / "prompts.json").read_text())
        assert info["prompts"] == PROMPTS and info["cfg"] == 2.0 and info["steps"] == 4 and info["seed"] == 3
        assert (info["width"], info["height"], info["contact_sheet"]) == (64, 64, "contact-sheet.png")  # the dataset's
        _assert_sheet_holds(folder / "contact-sheet.png", [_image(folder / f) for f in files[:2]])
    first, last = (_image(sampling_run / "samples" / f / "00-a-red-cat.png") for f in (folders[0], folders[-1]))
    assert np.abs(first.astype(int) - last.astype(int)).max() > 0, "training did not change the sample"
    events = EventAccumulator(str(sampling_run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert {"samples/00", "samples/01", "samples/contact_sheet"} <= set(events.Tags()["images"])
    assert [e.step for e in events.Images("samples/01")] == [0, 4, 8, 12]
    sheets = events.Images("samples/contact_sheet")
    assert [e.step for e in sheets] == [0, 4, 8, 12]
    with Image.open(sampling_run / "samples" / folders[-1] / "contact-sheet.png") as im:
        assert (sheets[-1].width, sheets[-1].height) == im.size
    log = (sampling_run.parent.parent / "train.log").read_text()
    lines = [line for line in log.splitlines() if "diffpipe: samples at step" in line]
    assert len(lines) == 4, lines  # one line per sampling point, naming its folder
    for line, name in zip(lines, folders, strict=True):
        assert re.search(rf"samples at step {int(name[5:])} in {sampling_run / 'samples' / name}: 2 images", line)


def _assert_sheet_holds(sheet_file: Path, images: list[np.ndarray]) -> None:
    """The contact sheet is the layout's size and holds each sample (enlarged by the layout's whole factor) in
    its cell, with text under it, and nothing else."""
    from diffpipe_core.sampling.contact_sheet import cell_size, sheet_layout

    h, w = images[0].shape[:2]
    layout = sheet_layout(len(images), cell_size(w, h))
    with Image.open(sheet_file) as im:
        sheet = np.asarray(im.convert("RGB"))
    assert (sheet.shape[1], sheet.shape[0]) == layout.size
    factor = layout.cell[0] // w
    cells = 0
    for i in range(layout.columns * layout.rows):
        x, y = layout.origin(i)
        tile = sheet[y : y + layout.cell[1], x : x + layout.cell[0]]
        caption = sheet[y + layout.cell[1] : y + layout.cell[1] + layout.caption_height, x : x + layout.cell[0]]
        if i < len(images):
            assert np.array_equal(tile, images[i].repeat(factor, 0).repeat(factor, 1)), f"cell {i}"
            assert (caption < 128).any(), f"no prompt under cell {i}"
            cells += 1
        else:
            assert (tile == 255).all() and (caption == 255).all(), f"cell {i} should be empty"
    assert cells == len(images)


@pytest.mark.slow
def test_sampling_leaves_the_training_losses_unchanged(sampling_run: Path, reference_two_stages: Path) -> None:
    with_samples, without = train_losses(sampling_run), train_losses(reference_two_stages)
    assert sorted(with_samples) == list(range(1, 13))
    assert with_samples == without  # bit for bit: same seed, sampling draws from its own generators


@pytest.mark.slow
def test_the_sampler_through_the_pipeline_engine_equals_the_sampler_with_a_direct_forward(sampling_run: Path) -> None:
    """Step 0 (LoRA B = 0, so the base model): the 2-stage run's sample vs the same sampler (``generate``) calling
    TinyDiT.forward in this process, with the same prompts, noise, CFG and steps; the trained step-12 sample is
    clearly different. Both sides run the same denoising loop, so this proves the forwards through the pipeline
    engine (stages, micro-batches, CFG batches, the sample's seeds), not the loop: the plugins' comparisons with the
    diffusers pipelines (the plugins' ``test_*_sample*_equals_the_pipeline*``) prove the sampler right."""
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
def test_decoder_loaded_once_and_text_encoders_not_resident_while_training(sampling_run: Path) -> None:
    records = [json.loads(line) for line in (sampling_run.parent.parent / "modules.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["when"] == "step"]
    decodes = [r for r in records if r["when"] == "decode"]
    loads = [r for r in records if r["when"] == "load_decoder"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert len(decodes) == 4 * len(PROMPTS)  # every sampling point decodes each prompt
    assert all("TinyVAE" in r["modules"] for r in decodes)  # the observer sees the decoder when it exists
    assert loads == [{"when": "load_decoder", "rank": "0", "device": "cpu"}]  # once, on rank 0, into host memory
    for r in steps:
        assert "TinyDiT" in r["modules"], r
        assert "ByteTextEncoder" not in r["modules"], r
        assert r["decoder_devices"] in ([], ["cpu"]), r  # between sampling points the decoder waits on the host


@pytest.mark.slow
def test_diffpipe_sample_repeats_the_training_sample(sampling_run: Path) -> None:
    """The saved final adapter, sampled by ``diffpipe sample`` on 2 processes (2 stages) with the run's config but
    its dataset folder gone, gives the very image the run wrote after its last step: same seed, prompt, CFG, steps,
    and the size from the dataset TOML (64 px) although its media are not there."""
    root = sampling_run.parent.parent
    (root / "gone").mkdir()
    write_dataset_toml(root / "gone" / "dataset.toml", root / "gone" / "images", resolutions=[64])
    config = (root / "run.toml").read_text().replace('dataset = "dataset.toml"', 'dataset = "gone/dataset.toml"')
    (root / "sample-gone.toml").write_text(config)
    out = root / "cli-sample.png"
    result = run_diffpipe(
        ["sample", "--config", "sample-gone.toml", "--adapter", str(sampling_run / "saved" / "final"), "--prompt",
         PROMPTS[0], "--out", str(out), "--num-procs", "2"],
        cwd=root,
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.output[-4000:]
    assert f"wrote {out}" in result.stdout
    assert "activations: none kept (sampling runs forward only)" in result.stdout  # not "the dataset is not cached"
    assert np.array_equal(_image(out), _image(sampling_run / "samples" / "step-0000012" / "00-a-red-cat.png"))
    base = _image(sampling_run / "samples" / "step-0000000" / "00-a-red-cat.png")
    assert not np.array_equal(_image(out), base)  # the adapter was applied
    assert sorted(p.name for p in (root / "gone").iterdir()) == ["dataset.toml"]  # no cache, no scan index


def test_diffpipe_sample_without_num_procs_samples_a_pipeline_run_on_one_process(sampling_run: Path) -> None:
    """The 2-stage run's own config, ``diffpipe sample`` without ``--num-procs`` (one process on a CPU machine):
    instead of refusing pipeline_stages = 2, it samples with the whole model, says so in one line naming
    ``--num-procs 2``, and gives the run's last sample."""
    root = sampling_run.parent.parent
    out = root / "one-process.png"
    result = run_diffpipe(
        ["sample", "--config", "run.toml", "--adapter", str(sampling_run / "saved" / "final"), "--prompt",
         PROMPTS[0], "--out", str(out)],
        cwd=root,
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.output[-4000:]
    assert (
        "diffpipe: sampling on 1 process with the whole model; pipeline_stages = 2 would need a multiple of 2 "
        "processes (--num-procs 2 samples through the 2-stage pipeline)"
    ) in result.stdout
    assert "stage plan (memory, 1 stage; activations: none kept" in result.stdout
    trained = _image(sampling_run / "samples" / "step-0000012" / "00-a-red-cat.png").astype(int)
    assert np.abs(_image(out).astype(int) - trained).max() <= 1  # 1 stage here, 2 in training: same maths


@pytest.mark.slow
def test_diffpipe_sample_needs_no_dataset_and_no_when_keys(sampling_run: Path) -> None:
    """``diffpipe sample`` (1 process) with a config holding only the model, a [sample] table without
    every_n_steps/every_n_epochs and a dataset TOML whose folder is empty: every prompt of [sample] into a folder,
    with the contact sheet and one line naming the folder, equal to the training run's last samples."""
    root = sampling_run.parent.parent
    (root / "empty" / "images").mkdir(parents=True)
    write_dataset_toml(root / "empty" / "dataset.toml", root / "empty" / "images", resolutions=[64])
    (root / "sample-only.toml").write_text(
        'dataset = "empty/dataset.toml"\n[model]\ntype = "reference"\npath = "model"\n'
        f'[sample]\nprompts = {json.dumps(PROMPTS)}\nnegative_prompt = "blurry"\nsteps = 4\ncfg = 2.0\nseed = 3\n'
    )
    out = root / "cli-samples"
    result = run_diffpipe(
        ["sample", "--config", "sample-only.toml", "--adapter", str(sampling_run / "saved" / "final"), "--out",
         str(out), "--num-procs", "1"],
        cwd=root,
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.output[-4000:]
    assert f"diffpipe: samples in {out}: 2 images, contact-sheet.png" in result.stdout
    trained = sampling_run / "samples" / "step-0000012"
    for name in ("00-a-red-cat.png", "01-a-blue-dog.png"):
        ours, theirs = _image(out / name).astype(int), _image(trained / name).astype(int)
        assert np.abs(ours - theirs).max() <= 1, name  # 1 stage here, 2 in training: same maths
    _assert_sheet_holds(out / "contact-sheet.png", [_image(out / n) for n in ("00-a-red-cat.png", "01-a-blue-dog.png")])
    assert sorted(p.name for p in (root / "empty").iterdir()) == ["dataset.toml", "images"]  # no cache written
    assert list((root / "empty" / "images").iterdir()) == []


def test_sampling_configs_need_neither_dataset_nor_when_keys(tmp_path: Path) -> None:
    """Finding 7 of issue 18: a [sample] table without every_n_steps/every_n_epochs, and no dataset or output_dir,
    are what ``diffpipe sample`` takes; training still asks for each."""
    write_tiny_model(tmp_path / "model")
    (tmp_path / "run.toml").write_text('[model]\ntype = "reference"\npath = "model"\n[sample]\nprompts = ["a"]\n')
    cfg = load_config(tmp_path / "run.toml", get_registry(), purpose="sample")
    assert cfg.run.dataset is None and cfg.run.sample is not None and cfg.run.sample.every_n_steps is None
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "run.toml", get_registry())
    text = "\n".join(exc.value.problems)
    assert "output_dir: required key is missing" in text and "dataset: required key is missing" in text
    assert "sample: say when to sample" in text


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
VIDEO_SPEC = replace(TINY_VIDEO_SPEC, name="tinyvideo-sampler", config_schema=reference.ReferenceConfig)


class TinyVideoSampler(ReferenceSampling):
    """The reference model on videos: latents ``(1, C, F, h, w)``, the frames stacked along the height for the
    DiT, each frame decoded by the reference VAE."""

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
    """Through the sampler's writing and logging: an MP4 that PyAV decodes to the requested 9 frames at the
    model's frame rate (``ModelSpec.video_fps``), the contact sheet of first frames, and TensorBoard's frame
    strip and sheet."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from diffpipe_core.sampling.decoder import HeldDecoder
    from diffpipe_core.sampling.output import log_sampling_point

    write_tiny_model(tmp_path / "model")
    registry = Registry()
    registry.register_model("tinyvideo-sampler", TinyVideoSampler())
    plugin = registry.model("tinyvideo-sampler")
    cfg = reference.ReferenceConfig(type="tinyvideo-sampler", path=tmp_path / "model")
    prompts = ["a red cat", "a blue dog"]
    texts = encode_prompts(plugin, cfg, prompts, None, torch.device("cpu"))
    model = plugin.require("load_diffusion_model", model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)
    forward = LayerChainForward(plugin.require("split_into_layers", model=model, model_config=cfg))
    request = sample_request(SampleConfig(prompts=prompts, steps=2), plugin, dataset=(64, 48, 9))
    assert (request.width, request.height, request.frames) == (64, 48, 9)
    latents = generate(plugin, cfg, request, texts, [noise_generator(0, i) for i in range(2)], forward)
    decoder = HeldDecoder(plugin, cfg, torch.device("cpu"))
    point = write_samples(decoder, dict(enumerate(latents)), prompts, request, tmp_path / "out", 8.0, step=5)
    writer = SummaryWriter(str(tmp_path / "tb"))
    log_sampling_point(writer, point)
    writer.close()
    assert point.files == [tmp_path / "out" / "00-a-red-cat.mp4", tmp_path / "out" / "01-a-blue-dog.mp4"]
    firsts = []
    for path in point.files:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
            assert float(stream.average_rate) == VIDEO_SPEC.video_fps
        assert len(frames) == 9 and frames[0].shape == (48, 64, 3)
        firsts.append(frames[0])
    assert json.loads((tmp_path / "out" / "prompts.json").read_text())["frames"] == 9
    stills = [s.still for s in point.samples]
    for still, first in zip(stills, firsts, strict=True):  # the sheet shows the first frame (MP4 is lossy)
        assert np.abs(still.astype(int) - first.astype(int)).mean() < 12
    _assert_sheet_holds(tmp_path / "out" / "contact-sheet.png", stills)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    (strip,) = events.Images("samples/00")
    assert (strip.step, strip.width, strip.height) == (5, 8 * 64, 48)  # 8 of the 9 frames side by side
    (sheet,) = events.Images("samples/contact_sheet")
    with Image.open(tmp_path / "out" / "contact-sheet.png") as im:
        assert (sheet.width, sheet.height) == im.size


def test_sample_size_defaults_to_the_dataset(tmp_path: Path) -> None:
    """The dataset's first resolution and frame bucket (its first directory's), rounded to the model; [sample]
    overrides; 512 px and the model's smallest video length without a dataset file."""
    toml = tmp_path / "dataset.toml"
    image_spec = get_registry().model("reference").spec
    write_dataset_toml(toml, tmp_path / "nothing-here", resolutions=[72, 512])
    assert dataset_shape(toml, image_spec) == (64, 64, 1)  # rounded down to 16
    write_dataset_toml(toml, tmp_path / "x", resolutions=[[96, 50]], frame_buckets=[1, 7, 9])
    assert dataset_shape(toml, image_spec) == (96, 48, 1)
    assert dataset_shape(toml, VIDEO_SPEC) == (96, 48, 9)  # 7 does not fit 4k + 1
    write_dataset_toml(toml, tmp_path / "x", directory_keys={"resolutions": [32], "frame_buckets": [1]})
    assert dataset_shape(toml, VIDEO_SPEC) == (32, 32, 5)  # images only: the smallest video length
    assert dataset_shape(tmp_path / "missing.toml", VIDEO_SPEC) is None
    assert sample_shape(SampleConfig(prompts=["a"]), VIDEO_SPEC, None) == (512, 512, 5)
    assert sample_shape(SampleConfig(prompts=["a"], resolution=[48, 32], frames=13), VIDEO_SPEC, (96, 48, 9)) == (
        48, 32, 13,
    )  # fmt: skip
    (tmp_path / "bad.toml").write_text('resolutions = "big"\n[[directory]]\npath = "x"\n')
    with pytest.raises(ConfigError, match="bad.toml.*resolutions"):
        dataset_shape(tmp_path / "bad.toml", image_spec)


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_contact_sheet_size_and_count(count: int) -> None:
    rng = np.random.default_rng(count)
    images = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(count)]
    prompts = [f"prompt number {i} " * (i + 1) for i in range(count)]  # long ones wrap and end in "..."
    sheet = contact_sheet(images, prompts)
    layout = sheet_layout(count, cell_size(64, 48))
    columns = {1: 1, 2: 2, 3: 2, 5: 3}[count]
    assert (layout.columns, layout.rows) == (columns, -(-count // columns))
    assert layout.cell == (192, 144)  # enlarged 3x so a prompt fits under it
    assert (sheet.shape[1], sheet.shape[0]) == layout.size
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        Image.fromarray(sheet).save(Path(tmp) / "sheet.png")
        _assert_sheet_holds(Path(tmp) / "sheet.png", images)


def test_contact_sheet_scales_large_samples_down() -> None:
    images = [np.full((1024, 768, 3), 40 * i, dtype=np.uint8) for i in range(4)]
    sheet = contact_sheet(images, ["a", "b", "c", "d"])
    layout = sheet_layout(4, cell_size(768, 1024))
    assert layout.cell == (384, 512) and (sheet.shape[1], sheet.shape[0]) == layout.size
    x, y = layout.origin(3)
    assert (sheet[y : y + 512, x : x + 384] == 120).all()


class RescaledCFG(ReferenceSampling):
    """The reference model with Qwen-Image's ``true_cfg_scale`` combination (the norm of the positive prediction
    kept), through the guidance hook."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []

    @hookimpl
    def model_spec(self):
        return ModelSpec(name="rescaled-cfg", modality="image", config_schema=reference.ReferenceConfig)

    @hookimpl
    def combine_guidance(self, uncond, cond, scale, schedule, index, model_config):
        self.calls.append((scale, index))
        combined = uncond + scale * (cond - uncond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))


def test_a_model_hook_combines_the_guided_predictions(tmp_path: Path) -> None:
    """Finding 8 of issue 18: the loop's result equals QwenImagePipeline's denoising loop (its comb_pred and norm
    rescale, written out here over the same model, noise and Euler steps), and differs from the plain combination,
    which stays the default."""
    write_tiny_model(tmp_path / "model")
    registry = Registry()
    hooks = RescaledCFG()
    registry.register_model("rescaled-cfg", hooks)
    plugin = registry.model("rescaled-cfg")
    cfg = reference.ReferenceConfig(type="rescaled-cfg", path=tmp_path / "model")
    (text,) = encode_prompts(plugin, cfg, ["a red cat"], "blurry", torch.device("cpu"))
    model = TinyDiT(read_config(tmp_path / "model"))
    model.load_state_dict(load_file(str(tmp_path / "model" / "transformer.safetensors")))
    model.eval()

    def forward(inputs):
        with torch.no_grad():
            return [model(*x) for x in inputs]

    request = SampleRequest(width=32, height=32, steps=3)
    (ours,) = generate(plugin, cfg, request, [text], [noise_generator(1, 0)], forward, cfg=4.0)
    assert hooks.calls == [(4.0, 0), (4.0, 1), (4.0, 2)]

    latents, sigmas = reference.denoise_init(request, cfg, noise_generator(1, 0))
    for i in range(3):
        t = sigmas[i].expand(1)
        with torch.no_grad():
            noise_pred = model(latents, t, text.cond["text_embeds"])
            neg_noise_pred = model(latents, t, text.uncond["text_embeds"])
        comb_pred = neg_noise_pred + 4.0 * (noise_pred - neg_noise_pred)
        cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
        latents = latents + (sigmas[i + 1] - sigmas[i]) * comb_pred * (cond_norm / noise_norm)
    torch.testing.assert_close(ours, latents, rtol=1e-5, atol=1e-5)

    plain = get_registry().model("reference")
    (default,) = generate(plain, cfg, request, [text], [noise_generator(1, 0)], forward, cfg=4.0)
    assert (default - ours).abs().max() > 1e-3  # without the hook: uncond + scale * (cond - uncond)


class DecoderInADict(ReferenceSampling):
    """A decoder object that is not a module itself: the VAE and a scale in a dict."""

    @hookimpl
    def model_spec(self):
        return ModelSpec(name="tuple-decoder", modality="image", config_schema=reference.ReferenceConfig)

    @hookimpl
    def load_decoder(self, model_config, device):
        return {"vae": reference.load_decoder(model_config, device), "scale": 1.0}

    @hookimpl
    def decode_latents(self, decoder, latents):
        return decoder["vae"].decode(latents) * decoder["scale"]


def test_the_decoder_is_loaded_once(tmp_path: Path) -> None:
    from diffpipe_core.sampling.decoder import HeldDecoder, find_modules

    write_tiny_model(tmp_path / "model")
    registry = Registry()
    registry.register_model("tuple-decoder", DecoderInADict())
    plugin = registry.model("tuple-decoder")
    cfg = reference.ReferenceConfig(type="tuple-decoder", path=tmp_path / "model")
    decoder = HeldDecoder(plugin, cfg, torch.device("cpu"))
    latents = torch.randn(1, 4, 4, 4)
    outputs = []
    for _ in range(3):  # three sampling points
        with decoder.session() as decode:
            outputs.append(decode(latents))
    assert decoder.loads == 1 and outputs[0].shape == (3, 32, 32)
    assert all(torch.equal(outputs[0], o) for o in outputs)
    held = plugin.require("load_decoder", model_config=cfg, device=torch.device("cpu"))
    assert [type(m).__name__ for m in find_modules(held)] == ["TinyVAE"]  # what moves to the accelerator
    assert find_modules(("a", 1, {"x": None})) == []


def test_a_model_without_an_unconditional_model_guides_as_before(tmp_path: Path) -> None:
    """A plugin that declares no ``unconditional_model`` (the reference model) samples at ``cfg > 1`` exactly as
    before the declaration existed: its negative prompt through the trained model in one batch of 2, combined as
    ``uncond + scale * (cond - uncond)`` (the loop written out here over the same model, noise and Euler steps); an
    unconditional forward handed to the loop is never called, and the sampler would load none
    (``runs_unconditional``, which ``PipelineSampler`` and the stage plan ask)."""
    from diffpipe_core.sampling.unconditional import runs_unconditional

    write_tiny_model(tmp_path / "model")
    plugin = get_registry().model("reference")
    assert plugin.spec.unconditional_model is None and not runs_unconditional(plugin, 4.0)
    cfg = reference.ReferenceConfig(type="reference", path=tmp_path / "model")
    (text,) = encode_prompts(plugin, cfg, ["a red cat"], "blurry", torch.device("cpu"))
    model = TinyDiT(read_config(tmp_path / "model"))
    model.load_state_dict(load_file(str(tmp_path / "model" / "transformer.safetensors")))
    model.eval()
    batches = []

    def forward(inputs):
        batches.extend(x[0].shape[0] for x in inputs)
        with torch.no_grad():
            return [model(*x) for x in inputs]

    def unconditional(inputs):
        raise AssertionError("a model without the declaration ran an unconditional model")

    request = SampleRequest(width=32, height=32, steps=3)
    (ours,) = generate(plugin, cfg, request, [text], [noise_generator(1, 0)], forward, cfg=4.0,
                       unconditional=unconditional)
    assert batches == [2, 2, 2]
    latents, sigmas = reference.denoise_init(request, cfg, noise_generator(1, 0))
    for i in range(3):
        t = sigmas[i].expand(1)
        with torch.no_grad():
            cond, uncond = model(latents, t, text.cond["text_embeds"]), model(latents, t, text.uncond["text_embeds"])
        latents = latents + (sigmas[i + 1] - sigmas[i]) * (uncond + 4.0 * (cond - uncond))
    torch.testing.assert_close(ours, latents, rtol=1e-5, atol=1e-5)
