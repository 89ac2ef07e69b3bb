"""The training loop: a plain loop around DeepSpeed's PipelineEngine.train_batch.

Determinism: the noise, timesteps and caption dropout of micro-batch ``m`` come from a generator
seeded by ``(seed, m, data-parallel rank)``, and torch's global RNG (LoRA dropout) is reseeded every
step from ``(seed, step, rank)``. So a run resumed from a checkpoint repeats exactly the losses the
uninterrupted run would have logged, and the first and last pipeline stages, which both draw the
micro-batch, agree on it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from diffpipe_core.adapters import apply_lora, lora_config, lora_state_dict, read_adapter
from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine import checkpoint as ckpt_io
from diffpipe_core.engine.ds_patches import (
    ExplicitPartitionPipelineModule,
    name_gradless_boundary_tensors,
    wrap_stage_boundaries,
)
from diffpipe_core.engine.grad_norm import clip_grads_, global_grad_norm
from diffpipe_core.engine.model_loading import load_for_stages, materialise_layers
from diffpipe_core.engine.partition import stage_parts
from diffpipe_core.engine.saving import export_model_formats, gather_to_rank0, write_adapter, write_model_shards
from diffpipe_core.memory import swapped_blocks, wrap_stage_layers
from diffpipe_core.optim import build_optimizer, lr_lambda
from diffpipe_core.quantize import quantize_stage
from diffpipe_core.quiet import library_prints
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.types import TrainingContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_CONSECUTIVE_NONFINITE = 5
EVAL_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)


def mix_seed(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


class MicroBatches:
    """The iterator DeepSpeed pulls micro-batches from: sampler -> collate -> prepare_inputs."""

    def __init__(
        self,
        dataset: Any,
        sampler: Any,
        plugin: ModelPlugin,
        context: TrainingContext,
        seed: int,
        dp_rank: int,
        micro_index: int,
    ) -> None:
        self.dataset, self.sampler, self.plugin, self.context = dataset, sampler, plugin, context
        self.seed, self.dp_rank, self.micro_index = seed, dp_rank, micro_index
        self.step_ids: list[str] = []
        self._it = iter(sampler)

    def __iter__(self) -> MicroBatches:
        return self

    def __next__(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        try:
            indices = next(self._it)
        except StopIteration:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._it = iter(self.sampler)
            indices = next(self._it)
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.micro_index, self.dp_rank))
        self.micro_index += 1
        self.step_ids.extend(self.dataset.sample_ids(indices))
        batch = self.dataset.collate(indices, generator)
        return self.plugin.require("prepare_inputs", batch=batch, context=self.context, generator=generator)


@dataclass
class TrainSummary:
    steps: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    skipped_steps: list[int] = field(default_factory=list)
    seconds: float = 0.0
    samples: int = 0
    first_quarter_loss: float | None = None  # mean training loss of the run's first quarter of steps
    last_quarter_loss: float | None = None


def quarter_means(run_dir: Path) -> tuple[float | None, float | None]:
    """Mean finite training loss of the first and of the last quarter of the run's steps (from metrics.jsonl,
    so a resumed run counts its steps before the resume too). Single steps are too noisy to show learning."""
    from diffpipe_core.engine.run_dir import train_losses

    losses = [v for _, v in sorted(train_losses(run_dir).items()) if v is not None and math.isfinite(v)]
    if not losses:
        return None, None
    q = max(1, len(losses) // 4)
    return sum(losses[:q]) / q, sum(losses[-q:]) / q


def format_summary(summary: TrainSummary) -> str:
    """The end-of-run line: steps, time, how the loss moved, skipped steps."""
    line = f"trained {summary.steps} steps ({summary.samples} samples) in {summary.seconds:.1f} s"
    first, last = summary.first_quarter_loss, summary.last_quarter_loss
    if first is not None and last is not None:
        change = f" ({(last - first) / first:+.0%})" if first > 0 else ""
        line += f"; mean loss {first:.4f} in the first quarter of steps -> {last:.4f} in the last{change}"
    if summary.skipped_steps:
        line += f"; skipped steps (non-finite loss): {summary.skipped_steps}"
    return line


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop the records of steps after ``step`` from ``metrics.jsonl`` (atomically): a resumed run logs
    them again, and each step must appear once."""
    from diffpipe_core.atomic import atomic_write_text

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by the kill
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


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

        self.cfg, self.run, self.plugin, self.dataset, self.run_dir = cfg, cfg.run, plugin, dataset, run_dir
        self.device = device
        self.eval_datasets = eval_datasets or {}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.stages = self.run.pipeline_stages
        self.dp = self.world // self.stages
        self.stage_id, self.dp_rank = self.rank // self.dp, self.rank % self.dp
        self.dtype = DTYPES[cfg.model.dtype]
        self.sampler = BucketSampler(
            dataset.groups(), self.run.micro_batch_size_per_gpu, self.dp_rank, self.dp, self.run.seed
        )
        gas = self.run.gradient_accumulation_steps
        if len(self.sampler) < gas:
            raise ValueError(
                f"the dataset gives {len(self.sampler)} micro-batches per epoch per data-parallel rank, fewer than "
                f"gradient_accumulation_steps={gas}; lower it or micro_batch_size_per_gpu, or add data"
            )
        self.steps_per_epoch = len(self.sampler) // gas
        self.total_steps = self.run.max_steps or self.run.epochs * self.steps_per_epoch
        self._build_model()
        self._nonfinite = False
        self.grad_norm: float | None = None

    # ----------------------------------------------------------------------------- model
    def _build_model(self) -> None:
        run, plugin = self.run, self.plugin
        stage = load_for_stages(plugin, self.cfg.model, self.device, self.dtype)
        self.parts = stage_parts(stage.layers, self.stages, run.partition_method, run.partition_split)
        own = range(self.parts[self.stage_id], self.parts[self.stage_id + 1])
        swapped = swapped_blocks(stage.layers, own, plugin.spec.block_layers, run.blocks_to_swap)
        if stage.per_stage_loading:  # swapped blocks are read straight into host memory
            resident = [i for i in own if i not in swapped]
            materialise_layers(plugin, self.cfg.model, stage, resident, self.device)
            materialise_layers(plugin, self.cfg.model, stage, swapped, torch.device("cpu"))
        label = f"stage {self.stage_id}" if self.dp_rank == 0 else None  # quantize_stage prints one line
        quantize_stage(self.cfg.model, stage, own, plugin.spec.block_layers, label)
        self.model = stage.model
        self.layer_names = [type(layer).__name__ for layer in stage.layers]
        torch.manual_seed(run.seed)
        if run.adapter is not None:
            targets = run.adapter.target_modules or plugin.require("lora_targets", model_config=self.cfg.model)
            self.lora = lora_config(run.adapter.rank, run.adapter.effective_alpha, run.adapter.dropout, list(targets))
            apply_lora(self.model, self.lora, DTYPES[run.adapter.dtype])
            if run.adapter.init_from_existing:
                self._init_adapter_from(run.adapter.init_from_existing)
        else:
            self.lora = None
            for p in self.model.parameters():
                p.requires_grad_(p.is_floating_point())
        layers, n_swapped = wrap_stage_layers(
            stage.layers, own, plugin.spec.block_layers, run.activation_checkpointing, run.blocks_to_swap, self.device
        )
        self._explain_memory_savers(n_swapped)
        with library_prints():  # DeepSpeed prints SEED_LAYERS=... and "Using topology: ..." here
            self.module = ExplicitPartitionPipelineModule(
                layers=wrap_stage_boundaries(layers, self.parts),
                parts=self.parts,
                num_stages=self.stages,
                loss_fn=lambda outputs, targets: plugin.require("compute_loss", outputs=outputs, targets=targets),
                dynamic_shape=True,
            )
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad and p.device.type != "meta"}
        if not self.trainable:
            raise ValueError(
                f"pipeline stage {self.stage_id} (layers {own.start}..{own.stop - 1}) has no trainable parameters; "
                "change partition_split or the adapter's target_modules"
            )
        self.optimizer = build_optimizer(run.optimizer, list(self.trainable.values()), plugin.registry.pm)
        self.scheduler = LambdaLR(self.optimizer, lr_lambda(run.lr_scheduler, run.warmup_steps, self.total_steps))
        self._guard_optimizer_step()
        ds_config = {
            "train_micro_batch_size_per_gpu": run.micro_batch_size_per_gpu,
            "gradient_accumulation_steps": run.gradient_accumulation_steps,
            "gradient_clipping": 0.0,  # done in _guard_optimizer_step
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            config=ds_config,
            model_parameters=list(self.trainable.values()),
        )
        if self.stage_id > 0:
            producer = self.parts[self.stage_id] - 1
            name_gradless_boundary_tensors(self.engine, f"layer {producer} ({self.layer_names[producer]})")

    def _explain_memory_savers(self, n_swapped: int) -> None:
        run, spec = self.run, self.plugin.spec
        if self.rank != 0 or not run.blocks_to_swap:
            return
        if not spec.block_layers:
            print(f"diffpipe: blocks_to_swap ignored: model {spec.name!r} names no block layers", flush=True)
        elif self.device.type != "cuda":
            print("diffpipe: blocks_to_swap has no effect without a GPU (weights live in host memory)", flush=True)
        elif self.lora is None:
            print("diffpipe: blocks_to_swap moves frozen weights only; a full fine-tune trains them all", flush=True)
        elif getattr(self.cfg.model, "quantize", None):
            print("diffpipe: blocks_to_swap moves unquantized weights only; quantized ones stay on the GPU", flush=True)
        else:
            print(f"diffpipe: swapping {n_swapped} blocks per stage with host memory", flush=True)

    def _init_adapter_from(self, path: Path) -> None:
        state, _ = read_adapter(path)
        prefix = self.plugin.call("adapter_key_prefix") or "transformer"
        named = dict(self.model.named_parameters())
        loaded = 0
        for key, value in state.items():
            if key.endswith(".alpha"):
                continue
            bare = key[len(prefix) + 1 :] if key.startswith(prefix + ".") else key
            name = bare.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
            if name in named and named[name].device.type != "meta":
                named[name].data.copy_(value.to(named[name].dtype))
                loaded += 1
        if loaded == 0 and any(p.device.type != "meta" for n, p in named.items() if "lora_" in n):
            raise ValueError(f"adapter.init_from_existing: {path} has no keys matching this model's LoRA layers")

    def _guard_optimizer_step(self) -> None:
        """Clip by the global gradient norm over all stages, and skip the optimizer step on every rank when
        any rank has a non-finite gradient, so a bad batch never reaches the weights or optimizer state.
        (Clipping here rather than in DeepSpeed gives us the pre-clip norm to log.)"""
        original = self.optimizer.step
        params = list(self.trainable.values())

        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            grads = [p.grad for p in params if p.grad is not None]
            self.grad_norm = global_grad_norm(grads, self.dp, self.device)
            if not math.isfinite(self.grad_norm):
                self._nonfinite = True
                self.optimizer.zero_grad(set_to_none=True)
                return None
            clip_grads_(grads, self.run.gradient_clipping, self.grad_norm)
            return original(*args, **kwargs)

        self.optimizer.step = guarded_step  # type: ignore[method-assign]

    # ----------------------------------------------------------------------------- state
    def _checkpoint(self, step: int, micro_index: int) -> None:
        state = {
            "step": step,
            "micro_index": micro_index,
            "sampler": self.sampler.state_dict(),
            "world_size": self.world,
            "pipeline_stages": self.stages,
            "total_steps": self.total_steps,
        }
        optim_state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        ckpt_io.write_checkpoint(
            self.run_dir,
            step,
            rank=self.rank,
            stage_id=self.stage_id,
            dp_rank=self.dp_rank,
            params=self.trainable,
            optimizer_state=optim_state,
            train_state=state,
            keep=self.run.keep_checkpoints,
            barrier=dist.barrier,
        )

    def _restore(self, ckpt: Path) -> dict[str, Any]:
        state = ckpt_io.read_train_state(ckpt)
        params = ckpt_io.read_params(ckpt)
        missing = [n for n in self.trainable if n not in params]
        if missing:
            raise ValueError(f"checkpoint {ckpt} lacks {len(missing)} trainable tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, p in self.trainable.items():
                p.copy_(params[name].to(p.dtype))
        if state.get("pipeline_stages") == self.stages and state.get("world_size") == self.world:
            optim = ckpt_io.read_optimizer_state(ckpt, self.stage_id)
            self.optimizer.load_state_dict(optim["optimizer"])
            self.scheduler.load_state_dict(optim["scheduler"])
        elif self.rank == 0:
            print(f"diffpipe: process layout changed since {ckpt.name}; optimizer state starts fresh", flush=True)
        self.sampler.load_state_dict(state["sampler"])
        return state

    def _save(self, name: str) -> Path:
        out = self.run_dir / "saved" / name
        save_dtype = DTYPES[self.run.save_dtype]
        if self.lora is not None:
            merged = gather_to_rank0(lora_state_dict(self.model), include=self.dp_rank == 0)
            if self.rank == 0:
                assert merged is not None
                problems = write_adapter(out, merged, self.plugin, self.lora, self.run.adapter.save_formats, save_dtype)
                self._report_save_problems(out, problems)
            dist.barrier()
        else:
            local = {n: p for n, p in self.model.state_dict().items() if p.device.type != "meta"}
            write_model_shards(
                out,
                local,
                rank=self.rank,
                stage_id=self.stage_id,
                dp_rank=self.dp_rank,
                num_stages=self.stages,
                dtype=save_dtype,
                barrier=dist.barrier,
            )
            if self.rank == 0 and self.run.save_model_formats:
                problems = export_model_formats(out, self.plugin, self.cfg.model, self.run.save_model_formats)
                self._report_save_problems(out, problems)
            dist.barrier()
        return out

    def _report_save_problems(self, out: Path, problems: list[str]) -> None:
        for problem in problems:
            print(f"diffpipe: ERROR saving {out}: {problem}", file=sys.stderr, flush=True)

    def evaluate(self, step: int, writer: Any) -> dict[str, float]:
        """Held-out loss of every eval dataset at fixed timestep quantiles (no dropout, no update).

        Every eval micro-batch of this rank's share goes through the pipeline once per quantile, with
        noise seeded by its position, so eval losses are comparable across steps and runs.
        """
        from diffpipe_core.data import BucketSampler

        results: dict[str, float] = {}
        for name, dataset in self.eval_datasets.items():
            per_quantile = []
            for q in EVAL_QUANTILES:
                sampler = BucketSampler(dataset.groups(), self.run.micro_batch_size_per_gpu, self.dp_rank, self.dp, 0)
                if len(sampler) == 0:
                    break
                context = TrainingContext(model_config=self.cfg.model, step=step, eval_quantile=q)
                batches = MicroBatches(dataset, sampler, self.plugin, context, self.run.seed + 1, self.dp_rank, 0)
                loss = float(self.engine.eval_batch(iter(batches), num_micro_batches=len(sampler)))
                per_quantile.append(loss)
                results[f"{name}/t_q{q:.1f}"] = loss
            if per_quantile:
                results[f"{name}/loss"] = sum(per_quantile) / len(per_quantile)
        if writer is not None:
            for key, value in results.items():
                writer.add_scalar(f"eval/{key}", value, step)
        if self.rank == 0 and results:
            means = ", ".join(f"{k.split('/')[0]} {v:.4f}" for k, v in results.items() if k.endswith("/loss"))
            tqdm.write(f"diffpipe: step {step} eval loss: {means}")
        return results

    # ----------------------------------------------------------------------------- loop
    def train(self, resume_from: Path | None = None) -> TrainSummary:
        run = self.run
        start_step, micro_index = 0, 0
        if resume_from is not None:
            state = self._restore(resume_from)
            start_step, micro_index = state["step"], state["micro_index"]
        context = TrainingContext(model_config=self.cfg.model)
        batches = MicroBatches(self.dataset, self.sampler, self.plugin, context, run.seed, self.dp_rank, micro_index)
        summary = TrainSummary()
        writer = self._writer() if self.rank == 0 else None
        if self.rank == 0 and resume_from is not None:
            truncate_metrics(self.run_dir, start_step)  # the steps after the checkpoint are logged again
        metrics_file = (self.run_dir / "metrics.jsonl").open("a") if self.rank == 0 else None
        bar = tqdm(
            total=self.total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            disable=self.rank != 0,
            dynamic_ncols=True,
        )
        if self.rank == 0 and self.sampler.remainder:
            print(
                f"diffpipe: {self.sampler.remainder} samples per epoch do not fill a micro-batch in their bucket; "
                "they are carried into later epochs by the reshuffle",
                flush=True,
            )
        if self.samples is not None:
            self.samples.before_training(start_step, writer)
        last_ckpt_time = time.monotonic()
        started = time.monotonic()
        consecutive_bad = 0
        samples_per_step = run.micro_batch_size_per_gpu * run.gradient_accumulation_steps * self.dp
        step = start_step
        while step < self.total_steps:
            torch.manual_seed(mix_seed(run.seed, step, self.rank))
            batches.step_ids = []
            context.step = step
            self._nonfinite = False
            lr = self.scheduler.get_last_lr()[0]  # the lr this step uses (train_batch steps the scheduler)
            t0 = time.perf_counter()
            loss = float(self.engine.train_batch(data_iter=batches))
            dt = time.perf_counter() - t0
            step += 1
            grad_norm = self.grad_norm
            if self._nonfinite or not math.isfinite(loss):
                consecutive_bad += 1
                summary.skipped_steps.append(step)
                ids = ", ".join(batches.step_ids) or "(held by the first stage)"
                if self.rank == 0 or self.stage_id == 0:
                    print(
                        f"diffpipe: non-finite loss ({loss}) at step {step}; optimizer step skipped; samples: {ids}",
                        flush=True,
                    )
                if consecutive_bad >= MAX_CONSECUTIVE_NONFINITE:
                    raise FloatingPointError(
                        f"{consecutive_bad} consecutive non-finite steps (last: step {step}); stopping. Saved "
                        "checkpoints and adapters are untouched"
                    )
            else:
                consecutive_bad = 0
                summary.first_loss = loss if summary.first_loss is None else summary.first_loss
                summary.last_loss = loss
            summary.steps += 1
            summary.samples += samples_per_step
            if self.rank == 0:
                record = {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": _num(grad_norm),
                    "samples_per_s": samples_per_step / dt,
                    "step_seconds": dt,
                    "epoch": self._epoch(step),
                }
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                if step % run.log_every_n_steps == 0:
                    for key in ("loss", "lr", "grad_norm", "samples_per_s"):
                        if record[key] is not None and math.isfinite(record[key]):
                            writer.add_scalar(f"train/{key}", record[key], step)
                    self.plugin.registry.pm.hook.on_train_step_end(step=step, metrics=record)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
                bar.update(1)
            epoch_done = step % self.steps_per_epoch == 0
            if (run.save_every_n_steps and step % run.save_every_n_steps == 0) or (
                epoch_done and run.save_every_n_epochs and self._epoch(step) % run.save_every_n_epochs == 0
            ):
                if step < self.total_steps:
                    self._save(f"step-{step:07d}")
            if self.eval_datasets and (
                (run.eval_every_n_steps and step % run.eval_every_n_steps == 0)
                or (epoch_done and run.eval_every_n_epochs and self._epoch(step) % run.eval_every_n_epochs == 0)
            ):
                evals = self.evaluate(step, writer)
                if metrics_file is not None and evals:
                    metrics_file.write(json.dumps({"step": step, "eval": evals}) + "\n")
                    metrics_file.flush()
            if self.samples is not None:
                self.samples.after_step(step, epoch_done, self._epoch(step), writer)
            if step < self.total_steps and self._checkpoint_due(step, last_ckpt_time):
                self._checkpoint(step, batches.micro_index)
                last_ckpt_time = time.monotonic()
        bar.close()
        summary.seconds = time.monotonic() - started
        final = self._save("final")
        self._checkpoint(step, batches.micro_index)
        if self.rank == 0:
            writer.close()
            metrics_file.close()
            summary.first_quarter_loss, summary.last_quarter_loss = quarter_means(self.run_dir)
            self.plugin.registry.pm.hook.on_train_end(run_dir=self.run_dir, summary=summary.__dict__)
            print(f"diffpipe: {format_summary(summary)}; saved to {final}", flush=True)
        return summary

    def _epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _checkpoint_due(self, step: int, last_time: float) -> bool:
        run = self.run
        if run.checkpoint_every_n_steps and step % run.checkpoint_every_n_steps == 0:
            return True
        if run.checkpoint_every_n_minutes:
            due = torch.tensor([1.0 if time.monotonic() - last_time >= 60 * run.checkpoint_every_n_minutes else 0.0])
            dist.broadcast(due, src=0)  # wall clocks differ per rank: rank 0 decides
            return bool(due.item())
        return False

    def _writer(self) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))


def _num(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)
