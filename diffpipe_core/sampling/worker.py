"""The training worker's side of sampling: encode the prompts before the model is loaded, give the trainer
its sampler, or (``diffpipe sample``) generate once from the base model plus a saved adapter."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.config import AdapterConfig, ResolvedConfig
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.sampling.config import SampleConfig, missing_sampling_hooks
from diffpipe_core.sampling.loop import PromptText
from diffpipe_core.sampling.runner import Layout, PipelineSampler, TrainingSamples, shared_prompt_texts


@dataclasses.dataclass
class WorkerSampling:
    """What a worker samples: the settings, the prompts and their encodings, and (``diffpipe sample``) where to."""

    sample: SampleConfig
    prompts: list[str]
    texts: list[PromptText]
    out: Path | None = None  # set for ``diffpipe sample``

    def _sampler(self, trainer: Any) -> PipelineSampler:
        layout = Layout(rank=trainer.rank, dp_rank=trainer.dp_rank, dp=trainer.dp, stage_id=trainer.stage_id)
        return PipelineSampler(
            self.sample, trainer.plugin, trainer.cfg.model, trainer.engine, layout, trainer.device, self.prompts,
            self.texts,
        )  # fmt: skip

    def attach(self, trainer: Any) -> None:
        """Sample during ``trainer.train()`` as ``[sample]`` says."""
        trainer.samples = TrainingSamples(self._sampler(trainer), trainer.run_dir)

    def sample_once(self, trainer: Any) -> list[Path]:
        """``diffpipe sample``: generate every prompt once into ``out`` (a folder, or one ``.png``/``.mp4`` file)."""
        assert self.out is not None
        single = self.out.suffix.lower() in (".png", ".mp4")
        if single and len(self.prompts) > 1:
            raise ValueError(f"--out {self.out}: one file but {len(self.prompts)} prompts; give a folder")
        folder = self.out.with_name(f".{self.out.name}.parts") if single else self.out
        written = self._sampler(trainer).sample(folder)
        if trainer.rank == 0 and single:
            if written[0].suffix != self.out.suffix.lower():
                raise ValueError(f"--out {self.out}: this model makes {written[0].suffix} files")
            os.replace(written[0], self.out)
            shutil.rmtree(folder, ignore_errors=True)
            written = [self.out]
        if trainer.rank == 0:
            for path in written:
                print(f"diffpipe: wrote {path}", flush=True)
        return written


def prepare_sampling(
    cfg: ResolvedConfig, plugin: ModelPlugin, device: torch.device, request_file: str | None
) -> tuple[ResolvedConfig, WorkerSampling | None]:
    """Encode the prompts (rank 0, encoders loaded for this only) before the diffusion model is loaded.

    Without ``request_file`` this is the run's ``[sample]`` table (None when absent). With it (written by
    ``diffpipe sample``) the prompts, output and overrides come from the command, and a given adapter folder
    replaces the run's ``[adapter]`` (its rank, alpha and target modules, loaded as ``init_from_existing``)."""
    request = json.loads(Path(request_file).read_text()) if request_file else None
    sample = cfg.run.sample
    if request is None and sample is None:
        return cfg, None
    if request is not None:
        cfg = _with_adapter(cfg, request.get("adapter"))
        overrides = {k: request[k] for k in ("prompts", "steps", "seed") if request.get(k) is not None}
        base = sample.model_dump() if sample is not None else {"prompts": overrides.get("prompts")}
        sample = SampleConfig.model_validate({**base, **overrides})
    assert sample is not None
    missing = missing_sampling_hooks(plugin)
    if missing:
        raise ValueError(f"model plugin {plugin.name!r} cannot sample: it does not implement {', '.join(missing)}")
    prompts = sample.prompt_list()
    texts = shared_prompt_texts(plugin, cfg.model, sample, prompts, device)
    out = Path(request["out"]) if request is not None else None
    return cfg, WorkerSampling(sample, prompts, texts, out)


def _with_adapter(cfg: ResolvedConfig, adapter: str | None) -> ResolvedConfig:
    if adapter is None:
        return cfg
    from diffpipe_core.adapter_kinds import adapter_table
    from diffpipe_core.adapters import read_adapter

    _, adapter_cfg = read_adapter(Path(adapter))
    table = AdapterConfig(**adapter_table(adapter_cfg, Path(adapter)))
    return dataclasses.replace(cfg, run=cfg.run.model_copy(update={"adapter": table}))
