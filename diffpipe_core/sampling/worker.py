"""The worker's side of sampling: for a training run, encode the ``[sample]`` prompts before the model is loaded
and give the trainer its sampler; for ``diffpipe sample``, build a forward-only pipeline engine (the training
stage builder, without dataset, optimizer or cache) and generate once from the base model plus a saved adapter."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diffpipe_core.config import AdapterConfig, ResolvedConfig
from diffpipe_core.engine.stage_build import Layout
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.sampling.config import SampleConfig, dataset_shape, missing_sampling_hooks
from diffpipe_core.sampling.loop import PromptText
from diffpipe_core.sampling.runner import (
    PipelineSampler,
    TrainingSamples,
    describe_point,
    sample_request,
    shared_prompt_texts,
)


@dataclasses.dataclass
class WorkerSampling:
    """What a worker samples: the settings, the prompts and their encodings, the dataset's first shape."""

    sample: SampleConfig
    prompts: list[str]
    texts: list[PromptText]
    dataset: tuple[int, int, int] | None

    def sampler(self, plugin: ModelPlugin, cfg: ResolvedConfig, engine: Any, layout: Layout, device: torch.device):
        return PipelineSampler(
            self.sample, plugin, cfg.model, engine, layout, device, self.prompts, self.texts, self.dataset
        )

    def attach(self, trainer: Any) -> None:
        """Sample during ``trainer.train()`` as ``[sample]`` says, through the trainer's own engine."""
        sampler = self.sampler(trainer.plugin, trainer.cfg, trainer.engine, trainer.layout, trainer.device)
        trainer.samples = TrainingSamples(sampler, trainer.run_dir)


def _encode(
    cfg: ResolvedConfig, plugin: ModelPlugin, sample: SampleConfig, device: torch.device
) -> WorkerSampling:
    missing = missing_sampling_hooks(plugin)
    if missing:
        raise ValueError(f"model plugin {plugin.name!r} cannot sample: it does not implement {', '.join(missing)}")
    prompts = sample.prompt_list()
    dataset = dataset_shape(cfg.run.dataset, plugin.spec)
    request = sample_request(sample, plugin, dataset)
    texts = shared_prompt_texts(plugin, cfg.model, sample, prompts, device, (request.width, request.height))
    return WorkerSampling(sample, prompts, texts, dataset)


def prepare_sampling(cfg: ResolvedConfig, plugin: ModelPlugin, device: torch.device) -> WorkerSampling | None:
    """A training run's ``[sample]`` (None without one): the prompts encoded now (rank 0, encoders loaded for
    this only), before the diffusion model is loaded."""
    if cfg.run.sample is None:
        return None
    return _encode(cfg, plugin, cfg.run.sample, device)


def run_sample_request(cfg: ResolvedConfig, plugin: ModelPlugin, device: torch.device, request_file: str) -> None:
    """``diffpipe sample`` on every rank: the request (written by the command) gives the prompts, the output
    and overrides of ``[sample]``; a given adapter folder is loaded onto the base model (its rank, alpha and
    target modules), without one the base model samples alone. Touches no dataset and no cache."""
    request = json.loads(Path(request_file).read_text())
    cfg = _with_adapter(cfg, request.get("adapter"))
    stages = request.get("pipeline_stages") or cfg.run.pipeline_stages
    if stages != cfg.run.pipeline_stages:  # the command samples on fewer stages than training used
        run = cfg.run.model_copy(update={"pipeline_stages": stages, "partition_split": None})
        cfg = dataclasses.replace(cfg, run=run)
    overrides = {k: request[k] for k in ("prompts", "steps", "seed") if request.get(k) is not None}
    sample = cfg.run.sample
    base = sample.model_dump() if sample is not None else {"prompts": overrides.get("prompts")}
    if "prompts" in overrides and len(base.get("control_images") or []) != len(overrides["prompts"]):
        base["control_images"] = None  # [sample]'s control images belong to its own prompts
    sample = SampleConfig.model_validate({**base, **overrides})
    out = Path(request["out"])
    single = out.suffix.lower() in (".png", ".mp4")
    work = _encode(cfg, plugin, sample, device)
    if single and len(work.prompts) > 1:
        raise ValueError(f"--out {out}: one file but {len(work.prompts)} prompts; give a folder")

    from diffpipe_core.engine.stage_build import build_inference_engine

    layout = Layout(dist.get_rank(), dist.get_world_size(), cfg.run.pipeline_stages)
    engine = build_inference_engine(cfg, plugin, layout, device)
    sampler = work.sampler(plugin, cfg, engine, layout, device)
    folder = out.with_name(f".{out.name}.parts") if single else out
    point = sampler.sample(folder, sheet=not single)
    if point is None:  # not rank 0
        return
    if not single:
        print(f"diffpipe: {describe_point(point)}", flush=True)
        return
    written = point.files[0]
    if written.suffix != out.suffix.lower():
        raise ValueError(f"--out {out}: this model makes {written.suffix} files")
    os.replace(written, out)
    shutil.rmtree(folder, ignore_errors=True)
    print(f"diffpipe: wrote {out}", flush=True)


def _with_adapter(cfg: ResolvedConfig, adapter: str | None) -> ResolvedConfig:
    """The run config with ``[adapter]`` replaced: the saved adapter's settings, any kind (loaded as
    ``init_from_existing``), or none (the base model alone)."""
    table = None
    if adapter is not None:
        from diffpipe_core.adapter_kinds import adapter_table
        from diffpipe_core.adapters import read_adapter

        _, adapter_cfg = read_adapter(Path(adapter))
        table = AdapterConfig(**adapter_table(adapter_cfg, Path(adapter)))
    return dataclasses.replace(cfg, run=cfg.run.model_copy(update={"adapter": table}))
