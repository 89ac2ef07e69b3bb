"""Sampling on every rank of a run: prompts shared over the data-parallel replicas, the denoising loop through the
run's ``PipelineEngine``, latents gathered to rank 0 and decoded there by a decoder loaded once (on the device only
while decoding), then the files, the contact sheet, TensorBoard and one line naming the folder."""

from __future__ import annotations

import math
import re
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diffpipe_core.atomic import atomic_save_safetensors, atomic_write_bytes
from diffpipe_core.engine.stage_build import Layout
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.sampling.config import SampleConfig, sample_shape
from diffpipe_core.sampling.contact_sheet import contact_sheet
from diffpipe_core.sampling.decoder import HeldDecoder
from diffpipe_core.sampling.loop import PromptText, generate, noise_generator
from diffpipe_core.sampling.output import (
    CONTACT_SHEET,
    SamplingPoint,
    WrittenSample,
    frame_strip,
    log_sampling_point,
    png_bytes,
    to_uint8,
    write_prompts,
    write_sample,
)
from diffpipe_core.sampling.pipeline import PipelineForward
from diffpipe_core.sampling.unconditional import HeldUnconditional, runs_unconditional
from diffpipe_core.types import ModelConfigBase, SampleRequest


def sample_request(
    sample: SampleConfig, plugin: ModelPlugin, dataset: tuple[int, int, int] | None = None
) -> SampleRequest:
    """What the denoising hooks get: ``[sample]``'s size and frames, else the dataset's first resolution and frame
    bucket (``dataset``, from :func:`diffpipe_core.sampling.config.dataset_shape`)."""
    width, height, frames = sample_shape(sample, plugin.spec, dataset)
    return SampleRequest(width=width, height=height, frames=frames, steps=sample.steps, guidance=sample.guidance)


def sample_file_stem(index: int, prompt: str) -> str:
    """``03-a-red-cat``: the prompt's position and a short filesystem-safe form of it."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40].rstrip("-")
    return f"{index:02d}-{slug}" if slug else f"{index:02d}"


class PipelineSampler:
    """Makes the configured samples through a built pipeline engine; every rank calls :meth:`sample`."""

    def __init__(
        self,
        sample: SampleConfig,
        plugin: ModelPlugin,
        model_config: ModelConfigBase,
        engine: Any,
        layout: Layout,
        device: torch.device,
        prompts: list[str],
        texts: list[PromptText],
        dataset: tuple[int, int, int] | None = None,
    ) -> None:
        self.config, self.plugin, self.model_config, self.engine = sample, plugin, model_config, engine
        self.layout, self.device, self.prompts, self.texts = layout, device, prompts, texts
        self.request = sample_request(sample, plugin, dataset)
        self.fps = float(plugin.spec.video_fps or 24.0)
        self.forward = PipelineForward(engine, device)
        self.decoder = HeldDecoder(plugin, model_config, device) if layout.rank == 0 else None
        # the declared unconditional model (cfg > 1): on each pipeline's last stage, which computes the predictions
        self.guided_by_model = runs_unconditional(plugin, sample.cfg)
        last = layout.stage_id == layout.stages - 1
        self.unconditional = HeldUnconditional(plugin, model_config, device) if self.guided_by_model and last else None
        if self.unconditional is not None:
            self.unconditional.load()  # host memory, before training: a missing file fails the run now

    def due(self, step: int, epoch_done: bool, epoch: int) -> bool:
        """After optimizer step ``step`` (1-based), at the configured interval."""
        s = self.config
        return bool(
            (s.every_n_steps and step % s.every_n_steps == 0)
            or (epoch_done and s.every_n_epochs and epoch % s.every_n_epochs == 0)
        )

    def generate(self) -> dict[int, torch.Tensor]:
        """Every prompt's final latents, on rank 0 (prompt index -> latents); {} elsewhere."""
        lay = self.layout
        n = len(self.texts)
        share = math.ceil(n / lay.dp)
        # Prompt i goes to data-parallel rank i % dp. Every replica runs the same number of micro-batches (the
        # engine's collectives need that), so a short share is padded with prompt 0 and the result dropped.
        mine = [lay.dp_rank + lay.dp * j for j in range(share)]
        work = [i if i < n else 0 for i in mine]
        held = self.unconditional.forward() if self.unconditional is not None else nullcontext()
        with held as chain:
            latents = generate(
                self.plugin,
                self.model_config,
                self.request,
                [self.texts[i] for i in work],
                [noise_generator(self.config.seed, i) for i in work],
                self.forward,
                cfg=self.config.cfg,
                unconditional=self.forward.unconditional(chain) if self.guided_by_model else None,
            )
        own = {i: lat for i, lat in zip(mine, latents, strict=True) if i < n} if lay.stage_id == 0 else {}
        gathered: list[Any] | None = [None] * dist.get_world_size() if lay.rank == 0 else None
        dist.gather_object(own, gathered, dst=0)
        if lay.rank != 0:
            return {}
        assert gathered is not None
        return {i: lat for part in gathered for i, lat in part.items()}

    def sample(
        self, out_dir: Path, step: int | None = None, writer: Any = None, sheet: bool = True
    ) -> SamplingPoint | None:
        """Generate every prompt and, on rank 0, write them into ``out_dir`` (:func:`write_samples`) and hand them
        to the loggers at ``step``. Returns the sampling point on rank 0, None elsewhere."""
        latents = self.generate()
        point = None
        if self.layout.rank == 0:
            assert self.decoder is not None
            meta = {"seed": self.config.seed, "cfg": self.config.cfg, "negative_prompt": self.config.negative_prompt}
            point = write_samples(
                self.decoder, latents, self.prompts, self.request, out_dir, self.fps, meta=meta, step=step, sheet=sheet
            )
            log_sampling_point(writer, point)
        dist.barrier()
        return point


def write_samples(
    decoder: HeldDecoder,
    latents: dict[int, torch.Tensor],
    prompts: list[str],
    request: SampleRequest,
    out_dir: Path,
    fps: float,
    meta: dict[str, Any] | None = None,
    step: int | None = None,
    sheet: bool = True,
) -> SamplingPoint:
    """Decode ``latents`` (prompt index -> final latents) one at a time and write ``out_dir/<NN-prompt>.png``
    (``.mp4`` at ``fps`` for videos, with the model's sound where it makes one: ``decode_audio``), the contact sheet
    (``contact-sheet.png``; with ``sheet``),
    ``latents.safetensors`` and ``prompts.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(
        {f"sample_{i:02d}": lat.contiguous() for i, lat in sorted(latents.items())}, out_dir / "latents.safetensors"
    )
    point = SamplingPoint(folder=out_dir, step=step, fps=fps)
    with decoder.session() as decode:
        for i, lat in sorted(latents.items()):
            media = to_uint8(decode(lat))
            video = media.ndim == 4
            sound = decode.audio(lat) if video else None
            audio, rate = (sound[0].numpy(), sound[1]) if sound is not None else (None, 0)
            file = write_sample(out_dir / sample_file_stem(i, prompts[i]), media, fps, audio, rate)
            point.samples.append(
                WrittenSample(
                    index=i,
                    prompt=prompts[i],
                    file=file,
                    still=media[0] if video else media,
                    strip=frame_strip(media) if video else None,
                    frames=media.shape[0] if video else 1,
                    audio=audio,
                    sample_rate=rate,
                )
            )
            del media
    info: dict[str, Any] = {"files": [s.file.name for s in point.samples], "step": step, "steps": request.steps}
    info |= {"guidance": request.guidance, "width": request.width, "height": request.height, "frames": request.frames}
    if sheet and point.samples:
        point.contact_sheet = contact_sheet([s.still for s in point.samples], [s.prompt for s in point.samples])
        point.contact_sheet_file = out_dir / CONTACT_SHEET
        atomic_write_bytes(point.contact_sheet_file, png_bytes(point.contact_sheet))
        info["contact_sheet"] = CONTACT_SHEET
    write_prompts(out_dir, prompts, info | (meta or {}))
    return point


def decode(
    plugin: ModelPlugin, model_config: ModelConfigBase, latents: dict[int, torch.Tensor], device: torch.device
) -> list[tuple[int, torch.Tensor]]:
    """Each sample's pixels (one at a time), with the decoder loaded for this call only and freed after."""
    decoder = HeldDecoder(plugin, model_config, device)
    try:
        with decoder.session() as run:
            return [(i, run(lat)) for i, lat in sorted(latents.items())]
    finally:
        decoder.close()


def shared_prompt_texts(
    plugin: ModelPlugin,
    model_config: ModelConfigBase,
    sample: SampleConfig,
    prompts: list[str],
    device: torch.device,
    size: tuple[int, int] | None = None,
) -> list[PromptText]:
    """Rank 0 encodes the prompts (and the negative prompt under CFG, and each prompt's ``control_images`` at the
    sample ``size``) with the plugin's encoders, loaded for this only; every rank receives the tensors. Called before
    the diffusion model is loaded."""
    from diffpipe_core.sampling.prompts import encode_prompts

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        # a model guided by its own unconditional model takes no negative prompt
        negative = sample.negative_prompt if sample.cfg > 1.0 and not runs_unconditional(plugin, sample.cfg) else None
        box[0] = encode_prompts(plugin, model_config, prompts, negative, device, sample.control_list(), size)
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainingSamples:
    """The trainer's view: sample before the first step and after the configured steps/epochs, into
    ``run_dir/samples/step-NNNNNNN/`` and TensorBoard's ``samples/NN`` and ``samples/contact_sheet``, with one
    line naming the folder."""

    def __init__(self, sampler: PipelineSampler, run_dir: Path) -> None:
        self.sampler, self.run_dir = sampler, run_dir

    def before_training(self, start_step: int, writer: Any) -> None:
        if start_step == 0 and self.sampler.config.before_first_step:
            self._sample(0, writer)

    def after_step(self, step: int, epoch_done: bool, epoch: int, writer: Any) -> None:
        if self.sampler.due(step, epoch_done, epoch):
            self._sample(step, writer)

    def _sample(self, step: int, writer: Any) -> None:
        started = time.perf_counter()
        point = self.sampler.sample(self.run_dir / "samples" / f"step-{step:07d}", step, writer)
        if point is not None:  # rank 0: one console line per sampling point, below the progress bar
            from tqdm import tqdm

            tqdm.write(f"diffpipe: {describe_point(point)} ({time.perf_counter() - started:.1f} s)")


def describe_point(point: SamplingPoint) -> str:
    """``samples at step 4 in /run/samples/step-0000004: 2 images, contact-sheet.png``."""
    n = len(point.samples)
    kind = "video" if any(s.frames > 1 for s in point.samples) else "image"
    when = f"samples at step {point.step}" if point.step is not None else "samples"
    sheet = f", {point.contact_sheet_file.name}" if point.contact_sheet_file is not None else ""
    return f"{when} in {point.folder}: {n} {kind}{'s' if n != 1 else ''}{sheet}"
