"""Sampling on every rank of a training run: prompts shared over the data-parallel replicas, the denoising
loop through the training ``PipelineEngine``, latents gathered and decoded on rank 0 by a VAE loaded only for
that and then freed, files and TensorBoard images written by rank 0."""

from __future__ import annotations

import gc
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diffpipe_core.atomic import atomic_save_safetensors
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.sampling.config import SampleConfig, default_frames
from diffpipe_core.sampling.loop import PromptText, generate, noise_generator
from diffpipe_core.sampling.output import log_sample, to_uint8, write_prompts, write_sample
from diffpipe_core.sampling.pipeline import PipelineForward
from diffpipe_core.types import ModelConfigBase, SampleRequest


def sample_request(sample: SampleConfig, plugin: ModelPlugin) -> SampleRequest:
    width, height = sample.size
    frames = sample.frames if sample.frames is not None else default_frames(plugin.spec)
    return SampleRequest(width=width, height=height, frames=frames, steps=sample.steps, guidance=sample.guidance)


def sample_file_stem(index: int, prompt: str) -> str:
    """``03-a-red-cat``: the prompt's position and a short filesystem-safe form of it."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40].rstrip("-")
    return f"{index:02d}-{slug}" if slug else f"{index:02d}"


@dataclass
class Layout:
    """Where this rank sits: data-parallel rank and degree, pipeline stage, global rank."""

    rank: int
    dp_rank: int
    dp: int
    stage_id: int


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
    ) -> None:
        self.config, self.plugin, self.model_config, self.engine = sample, plugin, model_config, engine
        self.layout, self.device, self.prompts, self.texts = layout, device, prompts, texts
        self.request = sample_request(sample, plugin)
        self.fps = float(plugin.spec.video_fps or 24.0)

    def due(self, step: int, epoch_done: bool, epoch: int) -> bool:
        """After optimizer step ``step`` (1-based), at the configured interval."""
        s = self.config
        return bool(
            (s.every_n_steps and step % s.every_n_steps == 0)
            or (epoch_done and s.every_n_epochs and epoch % s.every_n_epochs == 0)
        )

    def sample(self, out_dir: Path, step: int | None = None, writer: Any = None) -> list[Path]:
        """Generate every prompt, write ``out_dir/<NN-prompt>.png`` (``.mp4`` for videos), ``prompts.json`` and
        ``latents.safetensors`` on rank 0 (and TensorBoard images at ``step`` when ``writer`` is given).
        Returns the written sample files on rank 0, [] elsewhere."""
        lay = self.layout
        n = len(self.texts)
        share = math.ceil(n / lay.dp)
        # Prompt i goes to data-parallel rank i % dp. Every replica runs the same number of micro-batches (the
        # engine's collectives need that), so a short share is padded with prompt 0 and the result dropped.
        mine = [lay.dp_rank + lay.dp * j for j in range(share)]
        work = [i if i < n else 0 for i in mine]
        latents = generate(
            self.plugin,
            self.model_config,
            self.request,
            [self.texts[i] for i in work],
            [noise_generator(self.config.seed, i) for i in work],
            PipelineForward(self.engine, self.device),
            cfg=self.config.cfg,
        )
        own = {i: lat for i, lat in zip(mine, latents, strict=True) if i < n} if lay.stage_id == 0 else {}
        gathered: list[Any] | None = [None] * dist.get_world_size() if lay.rank == 0 else None
        dist.gather_object(own, gathered, dst=0)
        written: list[Path] = []
        if lay.rank == 0:
            assert gathered is not None
            merged = {i: lat for part in gathered for i, lat in part.items()}
            meta = {"seed": self.config.seed, "cfg": self.config.cfg, "negative_prompt": self.config.negative_prompt}
            written = write_samples(
                self.plugin, self.model_config, merged, self.prompts, self.request, out_dir, self.device, self.fps,
                meta=meta, step=step, writer=writer,
            )  # fmt: skip
        dist.barrier()
        return written


def write_samples(
    plugin: ModelPlugin,
    model_config: ModelConfigBase,
    latents: dict[int, torch.Tensor],
    prompts: list[str],
    request: SampleRequest,
    out_dir: Path,
    device: torch.device,
    fps: float,
    meta: dict[str, Any] | None = None,
    step: int | None = None,
    writer: Any = None,
) -> list[Path]:
    """Decode ``latents`` (prompt index -> final latents) and write ``out_dir/<NN-prompt>.png`` (``.mp4`` for
    videos), ``latents.safetensors`` and ``prompts.json``; log TensorBoard images at ``step`` when ``writer``
    is given. Returns the sample files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(
        {f"sample_{i:02d}": lat.contiguous() for i, lat in sorted(latents.items())}, out_dir / "latents.safetensors"
    )
    written = []
    for i, pixels in decode(plugin, model_config, latents, device):
        sample = to_uint8(pixels)
        written.append(write_sample(out_dir / sample_file_stem(i, prompts[i]), sample, fps))
        if writer is not None and step is not None:
            log_sample(writer, f"samples/{i:02d}", sample, step)
    info = {"files": [p.name for p in written], "step": step, "steps": request.steps, "guidance": request.guidance}
    info |= {"width": request.width, "height": request.height, "frames": request.frames, **(meta or {})}
    write_prompts(out_dir, prompts, info)
    if writer is not None:
        writer.flush()
    return written


def decode(
    plugin: ModelPlugin, model_config: ModelConfigBase, latents: dict[int, torch.Tensor], device: torch.device
) -> list[tuple[int, torch.Tensor]]:
    """Each sample's pixels (one at a time), with the decoder loaded for this call only and freed after."""
    decoder = plugin.require("load_decoder", model_config=model_config, device=device)
    try:
        out = []
        with torch.no_grad():
            for i, lat in sorted(latents.items()):
                pixels = plugin.require("decode_latents", decoder=decoder, latents=lat.to(device))
                out.append((i, pixels[0].float().cpu()))
        return out
    finally:
        del decoder
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def shared_prompt_texts(
    plugin: ModelPlugin, model_config: ModelConfigBase, sample: SampleConfig, prompts: list[str], device: torch.device
) -> list[PromptText]:
    """Rank 0 encodes the prompts (and the negative prompt under CFG) with the plugin's encoders, loaded for
    this only; every rank receives the text tensors. Called before the diffusion model is loaded."""
    from diffpipe_core.sampling.prompts import encode_prompts

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        negative = sample.negative_prompt if sample.cfg > 1.0 else None
        box[0] = encode_prompts(plugin, model_config, prompts, negative, device)
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainingSamples:
    """The trainer's view: sample before the first step and after the configured steps/epochs, into
    ``run_dir/samples/step-NNNNNNN/`` and TensorBoard's ``samples/NN``."""

    def __init__(self, sampler: PipelineSampler, run_dir: Path) -> None:
        self.sampler, self.run_dir = sampler, run_dir

    def before_training(self, start_step: int, writer: Any) -> None:
        if start_step == 0 and self.sampler.config.before_first_step:
            self._sample(0, writer)

    def after_step(self, step: int, epoch_done: bool, epoch: int, writer: Any) -> None:
        if self.sampler.due(step, epoch_done, epoch):
            self._sample(step, writer)

    def _sample(self, step: int, writer: Any) -> None:
        out = self.run_dir / "samples" / f"step-{step:07d}"
        written = self.sampler.sample(out, step, writer)
        if written:  # rank 0: one console line per sampling point
            from tqdm import tqdm

            tqdm.write(f"diffpipe: step {step}: {len(written)} samples in {out}")
