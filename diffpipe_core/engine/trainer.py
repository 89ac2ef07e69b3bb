"""The training loop: a plain loop around DeepSpeed's PipelineEngine.train_batch.

Determinism: the noise, timesteps and caption dropout of micro-batch ``m`` come from a generator
seeded by ``(seed, m, data-parallel rank)`` (:mod:`diffpipe_core.engine.micro_batches`), and torch's global RNG
(LoRA dropout) is reseeded every step from ``(seed, step, rank)``. So a run resumed from a checkpoint repeats
exactly the losses the uninterrupted run would have logged.

Building the stage, checkpoints and saves, evaluation and the guarded optimizer step each live in their own
module; this one only runs the steps and decides when each of those happens.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine import memory_report, stopping
from diffpipe_core.engine.cfg_training import draw, replay, uncond_pass
from diffpipe_core.engine.checkpoint import checkpoint_name
from diffpipe_core.engine.evaluation import evaluate
from diffpipe_core.engine.host_memory import release_freed
from diffpipe_core.engine.launcher import ERROR_DIR_ENV, stop_signal_name
from diffpipe_core.engine.layer_rng import seed_generators
from diffpipe_core.engine.metrics_writer import open_writer
from diffpipe_core.engine.micro_batches import MicroBatches, bucket_sizes, mix_seed
from diffpipe_core.engine.regularization import base_pass, dop_pass, needs_roles, step_roles, training_batch
from diffpipe_core.engine.run_dir import CHECKPOINTS, truncate_metrics
from diffpipe_core.engine.run_state import carried_micro_index, restore_checkpoint, save_trained, write_checkpoint
from diffpipe_core.engine.saving import saved_parts
from diffpipe_core.engine.stage_build import Layout, build_stage
from diffpipe_core.engine.summary import TrainSummary, format_summary, quarter_means
from diffpipe_core.optim import evaluation_weights
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.types import TrainingContext

MAX_CONSECUTIVE_NONFINITE = 5


class Trainer:
    """Builds the pipeline engine for this rank and runs the loop."""

    samples: Any = None  # a diffpipe_core.sampling.runner.TrainingSamples, attached by the worker for [sample]

    def __init__(
        self,
        cfg: ResolvedConfig,
        plugin: ModelPlugin,
        dataset: Any,
        run_dir: Path,
        device: torch.device,
        eval_datasets: dict[str, Any] | None = None,
    ) -> None:
        from diffpipe_core.data import BucketSampler
        from diffpipe_core.data.sampler import data_key

        self.cfg, self.run, self.plugin, self.dataset, self.run_dir = cfg, cfg.run, plugin, dataset, run_dir
        self.device = device
        self.eval_datasets = eval_datasets or {}
        self.layout = Layout(dist.get_rank(), dist.get_world_size(), self.run.pipeline_stages,
                             self.run.sequence_parallel)
        self.rank, self.world, self.stages = self.layout.rank, self.layout.world, self.layout.stages
        self.dp, self.stage_id, self.dp_rank = self.layout.dp, self.layout.stage_id, self.layout.dp_rank
        groups = dataset.groups()
        self.sampler = BucketSampler(groups, bucket_sizes(self.run, dataset, groups), self.dp_rank, self.dp,
                                     self.run.seed, data_key(dataset.sample_ids(list(range(len(dataset))))))
        gas = self.run.gradient_accumulation_steps
        if len(self.sampler) < gas:
            raise ValueError(
                f"the dataset gives {len(self.sampler)} micro-batches per epoch per data-parallel rank, fewer than "
                f"gradient_accumulation_steps={gas}; lower it or micro_batch_size_per_gpu, or add data"
            )
        self.steps_per_epoch = len(self.sampler) // gas
        self.total_steps = self.run.max_steps or self.run.epochs * self.steps_per_epoch
        memory_report.record("cached", self.stage_id)
        self.stage = build_stage(cfg, plugin, self.layout, device, self.total_steps, dataset)
        self.engine, self.model = self.stage.engine, self.stage.model
        self.weighted = needs_roles(dataset)  # regularisation folders, loss weights, class prompts: per-sample losses
        if self.weighted and dataset.roles.any_dop and cfg.model.cfg is not None:
            raise ValueError("diff_output_preservation and [model] cfg cannot be combined: the unconditional pass "
                             "covers the captions' samples, not the class prompts' second half of each micro-batch")
        release_freed()  # what loading and building freed
        self._memory_report("built")

    def _memory_report(self, phase: str) -> None:
        plan = self.stage.plan
        estimate = plan.stages[self.stage_id] if plan is not None else None
        memory_report.record(phase, self.stage_id, self.model, self.stage.optimizer, self.engine, estimate)

    # ----------------------------------------------------------------------------- state
    def _checkpoint(self, step: int, micro_index: int) -> None:
        write_checkpoint(
            self.run_dir, self.cfg, self.layout, self.stage, self.sampler, step, micro_index, self.total_steps
        )
        release_freed()  # the serialised optimizer state
        memory_report.record(f"checkpoint {step}", self.stage_id)

    def _save(self, name: str) -> Path:
        with evaluation_weights(self.stage.optimizer):
            saved = save_trained(self.run_dir, name, self.cfg, self.plugin, self.layout, self.stage)
        release_freed()  # the gathered and converted adapter
        memory_report.record(f"saved {name}", self.stage_id)
        return saved

    @contextlib.contextmanager
    def _sampling_weights(self) -> Iterator[None]:
        """The weights samples and eval losses use: the optimizer's evaluation weights, or the EMA with
        ``[ema] use_for_samples``."""
        ema = self.stage.ema
        with evaluation_weights(self.stage.optimizer):
            with ema.swapped_in(self.run.ema.use_for_samples) if ema is not None else contextlib.nullcontext():
                yield

    # ----------------------------------------------------------------------------- loop
    def train(
        self, resume_from: Path | None = None, reset_optimizer: bool = False, reset_dataloader: bool = False
    ) -> TrainSummary:
        """Train to ``total_steps`` and save; a signal stops it after a step with a checkpoint
        (:mod:`diffpipe_core.engine.stopping`, raising :class:`~diffpipe_core.engine.stopping.Stopped`). The resets
        apply to ``resume_from`` (:func:`~diffpipe_core.engine.run_state.restore_checkpoint`)."""
        start_step, micro_index = 0, 0
        if resume_from is not None:
            state = restore_checkpoint(resume_from, self.layout, self.stage, self.sampler, self.run.optimizer,
                                       reset_optimizer, reset_dataloader)
            start_step = state["step"]
            micro_index = carried_micro_index(state, self.layout)
            if start_step >= self.total_steps:
                if self.rank == 0:
                    print(f"diffpipe: run {self.run_dir} is finished (step {start_step} of {self.total_steps}); "
                          "nothing to train, nothing changed", flush=True)
                return TrainSummary()
            if self.rank == 0:
                truncate_metrics(self.run_dir, start_step)  # the steps after the checkpoint are logged again
        with stopping.graceful():
            return self._train(start_step, micro_index, resumed=resume_from is not None)

    def _train(self, start_step: int, micro_index: int, resumed: bool) -> TrainSummary:
        run = self.run
        context = TrainingContext(model_config=self.cfg.model, loss=run.loss)
        self.stage.loss.context = context
        batches = MicroBatches(
            self.dataset, self.sampler, self.plugin, context, run.seed, self.dp_rank, micro_index, self.dp
        )
        if self.stage.seeds is not None:
            self.stage.seeds.micro_index = micro_index
        summary = TrainSummary()
        writer = self._writer() if self.rank == 0 else None
        metrics_file = (self.run_dir / "metrics.jsonl").open("a") if self.rank == 0 else None
        if self.rank == 0 and self.sampler.remainder:
            print(
                f"diffpipe: {self.sampler.remainder} samples per epoch do not fill a micro-batch in their bucket; "
                "they are carried into later epochs by the reshuffle",
                flush=True,
            )
        bar = tqdm(
            total=self.total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            disable=self.rank != 0,
            dynamic_ncols=True,
        )
        try:
            if self.samples is not None:  # before any step the evaluation weights are the training ones
                self.samples.before_training(start_step, writer)
            if run.eval_before_first_step and self.eval_datasets and not resumed:
                self._log_eval(0, writer, metrics_file)
            self._loop(start_step, batches, context, summary, writer, metrics_file, bar)
        finally:
            bar.close()  # ends the bar's line: whatever is printed next (an error too) starts on its own
        step = self.total_steps
        final = self._save("final")
        self._checkpoint(step, batches.micro_index)
        if self.rank == 0:
            writer.close()
            metrics_file.close()
            summary.first_quarter_loss, summary.last_quarter_loss = quarter_means(self.run_dir)
            self.plugin.registry.pm.hook.on_train_end(run_dir=self.run_dir, summary=summary.__dict__)
            parts = saved_parts(Path(final)) if final is not None else []
            named = f" ({'; '.join(parts)})" if parts else ""
            print(f"diffpipe: {format_summary(summary)}; saved to {final}{named}", flush=True)
        return summary

    def _loop(
        self, step: int, batches: MicroBatches, context: TrainingContext, summary: TrainSummary, writer: Any,
        metrics_file: Any, bar: Any,
    ) -> None:
        run = self.run
        first_step = step
        last_ckpt_time = time.monotonic()
        started = time.monotonic()
        consecutive_bad = 0
        guard, scheduler = self.stage.guard, self.stage.scheduler
        while step < self.total_steps:
            seed_generators(mix_seed(run.seed, step, self.rank))
            batches.step_ids = []
            context.step = step
            guard.start_step()
            step_lrs = list(scheduler.get_last_lr())  # the lrs this step uses (train_batch steps the scheduler)
            lr = step_lrs[0]
            t0 = time.perf_counter()
            data: Any = batches
            if self.cfg.model.cfg is not None or self.weighted:  # the step's micro-batches are drawn ahead
                drawn = draw(batches, run.gradient_accumulation_steps)
                if self.cfg.model.cfg is not None:  # CFG-augmented training: the empty prompt's outputs first
                    _, uncond = uncond_pass(self.engine, batches, len(drawn), drawn)
                    self.stage.loss.uncond = list(uncond) if uncond is not None else None
                make = None
                if self.weighted:  # regularisation, loss weights, class prompts: the base model's outputs first
                    roles = step_roles(self.dataset, drawn)
                    if self.stage.base is not None:
                        base_pass(self.engine, batches, drawn, roles, self.stage.base)
                        dop_pass(self.engine, batches, drawn, roles, self.stage.base)
                    self.stage.loss.roles, make = roles, training_batch(batches, roles)
                data = replay(batches, drawn, make)
            try:
                loss = float(self.engine.train_batch(data_iter=data))
            finally:
                self.stage.loss.uncond = self.stage.loss.roles = None
            dt = time.perf_counter() - t0
            step += 1
            if memory_report.enabled():  # the report's step phases record what the stage holds
                release_freed()  # the step's activations and scratch (the next step would fault them back in)
            if step == first_step + 1:
                self._memory_report("step 1")
            else:
                memory_report.record(f"step {step}", self.stage_id)
            grad_norm = guard.grad_norm
            if guard.nonfinite or not math.isfinite(loss):
                consecutive_bad += 1
                summary.skipped_steps.append(step)
                ids = ", ".join(batches.step_ids) or "(held by the first stage)"
                if self.rank == 0 or self.stage_id == 0:
                    tqdm.write(
                        f"diffpipe: non-finite loss ({loss}) at step {step}; optimizer step skipped; samples: {ids}"
                    )
                if consecutive_bad >= MAX_CONSECUTIVE_NONFINITE:
                    raise FloatingPointError(
                        f"{consecutive_bad} consecutive non-finite steps (last: step {step}); stopping. Saved "
                        "checkpoints and adapters are untouched"
                    )
            else:
                consecutive_bad = 0
                if self.stage.ema is not None:
                    self.stage.ema.update(step)
                summary.first_loss = loss if summary.first_loss is None else summary.first_loss
                summary.last_loss = loss
            # rank 0's samples times the data-parallel ranks: exact unless micro-batch sizes differ by bucket
            samples_per_step = len(batches.step_ids) * self.dp
            summary.steps += 1
            summary.samples += samples_per_step
            summary.seconds = time.monotonic() - started
            if self.rank == 0:
                record = {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": _num(grad_norm),
                    "samples": samples_per_step,
                    "samples_per_s": samples_per_step / dt,
                    "step_seconds": dt,
                    "epoch": step / self.steps_per_epoch,
                }
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                if step % run.log_every_n_steps == 0:
                    for key in ("loss", "lr", "grad_norm", "samples_per_s", "epoch"):
                        if record[key] is not None and math.isfinite(record[key]):
                            writer.add_scalar(f"train/{key}", record[key], step)
                    groups = self.stage.optimizer.param_groups
                    if len(groups) > 1:  # per-component learning rates: one curve each
                        for group, group_lr in zip(groups, step_lrs, strict=True):
                            writer.add_scalar(f"train/lr_{group.get('name', 'model')}", group_lr, step)
                    self.plugin.registry.pm.hook.on_train_step_end(step=step, metrics=record)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)  # one redraw per step: update's
                bar.update(1)
            epoch_done = step % self.steps_per_epoch == 0
            if (run.save_every_n_steps and step % run.save_every_n_steps == 0) or (
                epoch_done and run.save_every_n_epochs and self._epoch(step) % run.save_every_n_epochs == 0
            ):
                if step < self.total_steps:
                    saved = self._save(f"step-{step:07d}")
                    if self.rank == 0:
                        tqdm.write(f"diffpipe: step {step}: saved {saved}")
            if self.eval_datasets and (
                (run.eval_every_n_steps and step % run.eval_every_n_steps == 0)
                or (epoch_done and run.eval_every_n_epochs and self._epoch(step) % run.eval_every_n_epochs == 0)
            ):
                self._log_eval(step, writer, metrics_file)
            if self.samples is not None and self.samples.sampler.due(step, epoch_done, self._epoch(step)):
                with self._sampling_weights():
                    self.samples.after_step(step, epoch_done, self._epoch(step), writer)
            checkpointed = False
            if step < self.total_steps and self._checkpoint_due(step, epoch_done, last_ckpt_time):
                self._checkpoint(step, batches.micro_index)
                last_ckpt_time, checkpointed = time.monotonic(), True
            signum = stopping.requested(self.device)
            if signum and step < self.total_steps:
                self._stop(step, batches.micro_index, signum, checkpointed)

    def _stop(self, step: int, micro_index: int, signum: int, checkpointed: bool) -> None:
        """Every rank, after ``step``: checkpoint it (unless just done) and leave with :class:`Stopped`."""
        if not checkpointed:
            self._checkpoint(step, micro_index)
        if self.rank == 0:
            procs = f" --num-procs {self.world}" if os.environ.get(ERROR_DIR_ENV) else ""
            tqdm.write(
                f"diffpipe: stopped by {stop_signal_name(signum)} after step {step} of {self.total_steps}; "
                f"checkpoint {CHECKPOINTS}/{checkpoint_name(step)} written. Resume with: diffpipe train --config "
                f"{shlex.quote(str(self.cfg.path))}{procs} --resume {shlex.quote(str(self.run_dir))}"
            )
        raise stopping.Stopped(signum, agreed=True)

    def evaluate(self, step: int, writer: Any) -> dict[str, float]:
        with self._sampling_weights():
            return evaluate(
                self.engine, self.eval_datasets, self.cfg, self.plugin, self.layout, step, writer, self.stage.loss
            )

    def _log_eval(self, step: int, writer: Any, metrics_file: Any) -> None:
        evals = self.evaluate(step, writer)
        if metrics_file is not None and evals:
            metrics_file.write(json.dumps({"step": step, "eval": evals}) + "\n")
            metrics_file.flush()

    def _epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _checkpoint_due(self, step: int, epoch_done: bool, last_time: float) -> bool:
        run = self.run
        if run.checkpoint_every_n_steps and step % run.checkpoint_every_n_steps == 0:
            return True
        if epoch_done and run.checkpoint_every_n_epochs and self._epoch(step) % run.checkpoint_every_n_epochs == 0:
            return True
        if run.checkpoint_every_n_minutes:
            due = torch.tensor([1.0 if time.monotonic() - last_time >= 60 * run.checkpoint_every_n_minutes else 0.0])
            dist.broadcast(due, src=0)  # wall clocks differ per rank: rank 0 decides
            return bool(due.item())
        return False

    def _writer(self) -> Any:
        return open_writer(self.run_dir, self.run.logging.wandb)


def _num(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)
