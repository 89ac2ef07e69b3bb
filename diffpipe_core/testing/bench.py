"""Benchmarks that compare two sides (diffpipe and a plain loop) on a machine whose load drifts.

Timing all of one side and then all of the other lets a change in load look like a difference between
them. :func:`alternate` measures the two sides in pairs, swapping which goes first in every other pair, and
:func:`ratio_report` summarises the per-pair ratios by their median and spread.

The framework-overhead benches (``bench/overhead.py`` and each model plugin's ``bench/step_time.py``) also share
:func:`bench_parser`, :func:`overhead_args`, :func:`model_table`, :func:`clip_dataset`, :func:`write_run_toml`,
:func:`train_times`, :func:`diffpipe_step_times`, :func:`plain_model`, :func:`flow_loss`, :func:`plain_step_times`,
:func:`measure_overhead`, :func:`compare`, :func:`pair_line` and :func:`ratio_line`; each bench supplies only its
model, ``[model]`` table and loss. An image model's bench is :func:`image_trainer` (the diffpipe side),
:func:`plain_trainer` (the plain loop: the bench gives only its model's inputs and forward call) and
:func:`run_bench` (the command line, the pairs and the printed result).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def alternate(measure_a: Callable[[], float], measure_b: Callable[[], float], pairs: int,
              report: Callable[[int, float, float], None] | None = None) -> list[tuple[float, float]]:
    """``pairs`` (at least 3) measurements ``(a, b)`` taken back to back, A first in even pairs and B first in
    odd ones. ``report(i, a, b)`` is called after each pair."""
    if pairs < 3:
        raise ValueError(f"pairs={pairs}: at least 3 pairs are needed for a median and a spread")
    out = []
    for i in range(pairs):
        if i % 2 == 0:
            a = measure_a()
            b = measure_b()
        else:
            b = measure_b()
            a = measure_a()
        out.append((a, b))
        if report is not None:
            report(i, a, b)
    return out


def ratio_report(pairs: list[tuple[float, float]], what: str = "ratio") -> str:
    """``"<what>: median 1.043 over 5 alternating pairs (spread 0.998-1.101, IQR 1.012-1.067)"``: the median of
    the per-pair ratios a / b, their range and interquartile range."""
    ratios = sorted(a / b for a, b in pairs)
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return (f"{what}: median {statistics.median(ratios):.3f} over {len(ratios)} alternating pairs "
            f"(spread {ratios[0]:.3f}-{ratios[-1]:.3f}, IQR {q1:.3f}-{q3:.3f})")

LORA_RANK = 16


def write_run_toml(root: Path, model_table: str, steps: int, batch: int) -> Path:
    """``root/run.toml`` for a 1-worker overhead run: ``dataset.toml`` in ``root``, output in ``root/out``, LoRA
    rank 16, lr 1e-4. ``model_table`` is the body of the ``[model]`` table (TOML lines)."""
    path = root / "run.toml"
    path.write_text(
        f"""
output_dir = "out"
dataset = "dataset.toml"
max_steps = {steps}
micro_batch_size_per_gpu = {batch}
gradient_accumulation_steps = 1
seed = 1
[model]
{model_table.strip()}
[adapter]
rank = {LORA_RANK}
[optimizer]
lr = 1e-4
"""
    )
    return path


def model_table(model_type: str, **keys: object) -> str:
    """The body of an overhead run's ``[model]`` table: ``model_type`` from ``root/model`` with weights and encoders
    in float32, then ``keys`` (which may replace those)."""
    from diffpipe_core.anchor.keys import toml_key, toml_value

    table = {"type": model_type, "path": "model", "dtype": "float32", "encoder_dtype": "float32", **keys}
    return "\n".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items())


def train_times(root: Path, args: argparse.Namespace, table: str, timeout: float = 1800) -> list[float]:
    """:func:`write_run_toml` of ``table`` for ``args.steps`` steps of ``args.batch`` in ``root`` (which holds the
    dataset), then :func:`diffpipe_step_times`."""
    write_run_toml(root, table, args.steps, args.batch)
    return diffpipe_step_times(root, timeout)


def plain_model(plugin: object, model_dir: Path, **keys: object) -> tuple[object, torch.nn.Module]:
    """``(config, model)`` of the plain side: the plugin's diffusion model from ``model_dir`` in float32 on the CPU
    (its ``[model]`` table: the plugin's type, ``path`` and ``keys``), loaded after ``torch.manual_seed(0)``."""
    import torch

    from diffpipe_core.schema import validate

    spec = plugin.model_spec()  # type: ignore[attr-defined]
    cfg = validate(spec.config_schema, {"type": spec.name, "path": model_dir, "dtype": "float32", **keys}, "bench")
    torch.manual_seed(0)
    model = plugin.load_diffusion_model(model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)  # type: ignore[attr-defined]
    return cfg, model


def diffpipe_step_times(root: Path, timeout: float = 1800) -> list[float]:
    """Run `diffpipe train --config run.toml --num-procs 1` in ``root`` (HF_HOME in ``root``, so the text
    encoders' cache is the run's own) and return the newest run's step seconds from its metrics.jsonl. Exits with
    the end of diffpipe's output if the run fails."""
    from diffpipe_core.engine.run_dir import step_seconds
    from diffpipe_core.testing.processes import cli_env, run_diffpipe

    env = cli_env(HF_HOME=str(root / "hf_home"))
    result = run_diffpipe(["train", "--config", "run.toml", "--num-procs", "1"], cwd=root, timeout=timeout, env=env)
    if result.returncode != 0:
        sys.exit(result.output[-3000:])
    return step_seconds(sorted((root / "out").iterdir())[-1])


def plain_step_times(
    model: torch.nn.Module, lora_targets: list[str], loss: Callable[[torch.Generator], torch.Tensor], steps: int
) -> list[float]:
    """Seconds of each of ``steps`` plain PyTorch training steps: ``loss(generator)`` (the model's forward and
    objective), backward, gradient clipping at 1.0 and an AdamW step (diffpipe's defaults) on the trainable
    parameters of ``model`` after a peft LoRA of rank 16 on ``lora_targets``."""
    import torch

    from diffpipe_core.adapters import apply_lora, lora_config

    apply_lora(model, lora_config(LORA_RANK, LORA_RANK, 0.0, lora_targets))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss(gen).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def flow_loss(
    latents: torch.Tensor,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    layout: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **timesteps: float,
) -> Callable[[torch.Generator], torch.Tensor]:
    """The plain side's rectified-flow loss on ``latents`` for :func:`plain_step_times`: noise and times (
    ``sample_timesteps(**timesteps)``) from the step's generator, ``forward(x_t, t)`` the model's prediction, its
    masked MSE to the velocity (put in the prediction's ``layout``, e.g. the model's packing)."""
    import torch

    from diffpipe_core.diffusion import flow_matching_pair, masked_mse, sample_timesteps

    def loss(gen: torch.Generator) -> torch.Tensor:
        noise = torch.randn(latents.shape, generator=gen)
        t = sample_timesteps(latents.shape[0], gen, **timesteps)
        x_t, target = flow_matching_pair(latents, noise, t)
        return masked_mse(forward(x_t, t), target if layout is None else layout(target))

    return loss


def after_warmup(times: list[float], warmup: int) -> float:
    """The median of ``times`` after the first ``warmup``; exits naming both if no step is left."""
    if len(times) <= warmup:
        sys.exit(f"{len(times)} steps measured but --warmup {warmup}: use --steps above --warmup")
    return statistics.median(times[warmup:])


def pair_line(i: int, ours: float, plain: float, label: str = "pair", plain_name: str = "plain PyTorch") -> str:
    """``"pair 1: diffpipe 123.4 ms, plain PyTorch 120.1 ms, ratio 1.027"`` for pair index ``i``."""
    return (f"{label} {i + 1}: diffpipe {ours * 1000:.1f} ms, {plain_name} {plain * 1000:.1f} ms, "
            f"ratio {ours / plain:.3f}")


def compare(measure_ours: Callable[[], float], measure_plain: Callable[[], float], pairs: int,
            report: Callable[[int, float, float], None], smoke: bool = False) -> list[tuple[float, float]]:
    """:func:`alternate` the two sides for ``pairs`` pairs; with ``smoke``, one pair only (a check that the bench
    runs end to end, not a measurement: :func:`ratio_report` needs more than one pair)."""
    if not smoke:
        return alternate(measure_ours, measure_plain, pairs, report)
    ours, plain = measure_ours(), measure_plain()
    report(0, ours, plain)
    return [(ours, plain)]


SMOKE_HELP = "one pair only, to check the bench runs end to end (not a measurement: no spread)"


def bench_parser(steps: int = 20, warmup: int = 4, batch: int = 1, pairs: str = "--pairs",
                 threads: bool = False) -> argparse.ArgumentParser:
    """The options every overhead bench has: ``--steps``, ``--warmup``, ``--batch``, the pair count (``pairs``,
    e.g. ``--pairs`` or ``--rounds``, default 3), ``--smoke`` and, with ``threads``, ``--threads`` (see
    :func:`use_threads`). Keeps the libraries' chatter behind ``DIFFPIPE_VERBOSE=1`` from here on, as the CLI
    does (:func:`diffpipe_core.quiet.quiet_script`)."""
    from diffpipe_core.quiet import quiet_script

    quiet_script()
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument(pairs, type=int, default=3, help="alternating diffpipe / plain pairs (at least 3)")
    if threads:
        parser.add_argument(
            "--threads", type=int, default=1, help="CPU threads of both sides (more than the free cores stalls either)"
        )
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    return parser


def use_threads(threads: int) -> None:
    """``threads`` CPU threads for the plain side (torch) and the diffpipe worker (OMP_NUM_THREADS)."""
    import torch

    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def measure_overhead(
    args: argparse.Namespace,
    write_model: Callable[[Path], object],
    diffpipe_times: Callable[[Path, argparse.Namespace], list[float]],
    plain_times: Callable[[Path, argparse.Namespace], list[float]],
    pairs: int,
    show: Callable[[int, float, float], None] | None = None,
    label: str = "pair",
) -> list[tuple[float, float]]:
    """An overhead bench's pairs: the tiny model written once (``write_model(model_dir)``) in a temporary folder,
    then :func:`compare` of diffpipe (``diffpipe_times(root, args)`` in a new ``root`` each pair, whose ``model``
    links to the model) and the plain loop (``plain_times(model_dir, args)``), each side's median after
    ``args.warmup`` steps. ``show(i, ours, plain)`` reports each pair (default: :func:`pair_line` with ``label``)."""
    if show is None:
        def show(i: int, ours: float, plain: float) -> None:
            print(pair_line(i, ours, plain, label=label), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir)
        count = itertools.count()

        def ours() -> float:
            root = Path(tmp) / f"run{next(count)}"
            root.mkdir()
            (root / "model").symlink_to(model_dir)
            return after_warmup(diffpipe_times(root, args), args.warmup)

        def plain() -> float:
            return after_warmup(plain_times(model_dir, args), args.warmup)

        return compare(ours, plain, pairs, show, args.smoke)


def overhead_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments (:func:`bench_parser`'s and a bench's own), its ``--threads`` applied
    (:func:`use_threads`), the Hub offline."""
    args = parser.parse_args()
    if hasattr(args, "threads"):
        use_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return args


def clip_dataset(root: Path, write_clips: Callable[..., object], frames: int, width: int, height: int) -> None:
    """4 captioned clips of ``frames + 2`` frames at ``width`` x ``height`` in ``root/clips`` (``write_clips``: the
    plugin's clip writer) and ``root/dataset.toml`` over them: that size, one frame bucket of ``frames``."""
    from diffpipe_core.testing.media import write_dataset_toml

    data = root / "clips"
    write_clips(data, [f"a clip {i}" for i in range(4)], frames=frames + 2, size=(width, height))
    write_dataset_toml(
        root / "dataset.toml", data, resolutions=[[width, height]], enable_ar_bucket=False, frame_buckets=[frames]
    )


def ratio_line(pairs: list[tuple[float, float]], what: str = "overhead ratio", unit: str = "pairs") -> str:
    """``"overhead ratio: 1.043 (median of 3 pairs, spread 0.998-1.101; target <= 1.10)"``."""
    ratios = [a / b for a, b in pairs]
    return (f"{what}: {statistics.median(ratios):.3f} (median of {len(ratios)} {unit}, spread "
            f"{min(ratios):.3f}-{max(ratios):.3f}; target <= 1.10)")


def clip_trainer(
    write_clips: Callable[..., object], frames: int, width: int, height: int, table: str
) -> Callable[[Path, argparse.Namespace], list[float]]:
    """A video bench's ``diffpipe_times``: in ``root`` (which holds ``model/``), :func:`clip_dataset` of ``frames`` at
    ``width`` x ``height``, then :func:`train_times` with the ``[model]`` ``table``."""

    def diffpipe_times(root: Path, args: argparse.Namespace) -> list[float]:
        clip_dataset(root, write_clips, frames, width, height)
        return train_times(root, args, table)

    return diffpipe_times


def setup_line(model: str, args: argparse.Namespace) -> str:
    """What an overhead bench measured: ``model`` (its size and tokens), then the batch, the LoRA, the dtype, the CPU
    threads and the steps each median is over."""
    import torch

    return (f"model: {model}, batch {args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; "
            f"medians of {args.steps - args.warmup} steps after {args.warmup} warm-up")


#: the plain side's inputs of one model: ``(latents, forward, layout)`` for :func:`flow_loss`
PlainInputs = tuple["torch.Tensor", Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"],
                    Callable[["torch.Tensor"], "torch.Tensor"] | None]


def image_trainer(table: str, captions: Callable[[int], str], size: int
                  ) -> Callable[[Path, argparse.Namespace], list[float]]:
    """An image bench's ``diffpipe_times``: in ``root`` (which holds ``model/``), 4 ``size`` x ``size`` images captioned
    ``captions(i)`` and their ``dataset.toml`` (that size, no aspect buckets), then :func:`train_times` with the
    ``[model]`` ``table``."""
    from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset

    def diffpipe_times(root: Path, args: argparse.Namespace) -> list[float]:
        write_image_dataset(root / "images", 4, size=(size, size), captions=[captions(i) for i in range(4)])
        write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[size], enable_ar_bucket=False)
        return train_times(root, args, table)

    return diffpipe_times


def plain_trainer(plugin: object, inputs: Callable[[torch.nn.Module, int], PlainInputs], **keys: object
                  ) -> Callable[[Path, argparse.Namespace], list[float]]:
    """A bench's ``plain_times``: the plugin's model from ``model_dir`` (:func:`plain_model` with ``keys``), then
    :func:`plain_step_times` of the rectified-flow loss (:func:`flow_loss`) on ``inputs(model, batch)``: the
    latents, the model's forward call ``forward(x_t, t)`` and the prediction's layout. The model's LoRA targets are
    the plugin's."""

    def plain_times(model_dir: Path, args: argparse.Namespace) -> list[float]:
        cfg, model = plain_model(plugin, model_dir, **keys)
        latents, forward, layout = inputs(model, args.batch)
        targets = plugin.lora_targets(model_config=cfg)  # type: ignore[attr-defined]
        return plain_step_times(model, targets, flow_loss(latents, forward, layout), args.steps)

    return plain_times


def tokens_line(size: int, text_len: int, patch: int = 16) -> str:
    """``"256 image + 64 text tokens"``: a ``size`` x ``size`` image in ``patch``-pixel tokens and the text's."""
    return f"{(size // patch) ** 2} image + {text_len} text tokens"


def run_bench(
    write_model: Callable[[Path], object],
    diffpipe_times: Callable[[Path, argparse.Namespace], list[float]],
    plain_times: Callable[[Path, argparse.Namespace], list[float]],
    model: str,
) -> None:
    """An overhead bench's command line (:func:`bench_parser` with ``--rounds`` and ``--threads``): the
    :func:`measure_overhead` rounds, then what was measured (:func:`setup_line` of ``model``) and the
    :func:`ratio_line`."""
    args = overhead_args(bench_parser(pairs="--rounds", threads=True))
    pairs = measure_overhead(args, write_model, diffpipe_times, plain_times, args.rounds, label="round")
    print(setup_line(model, args))
    print(ratio_line(pairs))


def audio_share_pairs(
    args: argparse.Namespace, write_model: Callable[[Path], object], write_clips: Callable[..., object],
    frames: int, width: int, height: int, model_type: str, **keys: object,
) -> list[tuple[float, float]]:
    """The audio branch's share of a step (issue 40): ``diffpipe train`` of ``model_type`` (``write_model``'s folder,
    ``keys`` in its ``[model]`` table) on the same :func:`clip_dataset` of clips with a 440 Hz tone track
    (``write_clips(folder, captions, frames=, size=, audio="tone")``), with ``train_audio = true`` and ``false``
    alternating for ``args.pairs`` pairs; each side's median step time after warm-up. Returns ``(with audio, without)``
    pairs, printing each."""
    import functools

    tables = {audio: model_table(model_type, **keys, train_audio=audio) for audio in (True, False)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir)
        count = itertools.count()

        def side(audio: bool) -> float:
            root = Path(tmp) / f"run{next(count)}"
            root.mkdir()
            (root / "model").symlink_to(model_dir)
            clip_dataset(root, functools.partial(write_clips, audio="tone"), frames, width, height)
            return after_warmup(train_times(root, args, tables[audio]), args.warmup)

        def show(i: int, with_audio: float, without: float) -> None:
            print(f"pair {i + 1}: with audio {with_audio * 1000:.1f} ms, without {without * 1000:.1f} ms, "
                  f"ratio {with_audio / without:.3f}", flush=True)

        return compare(lambda: side(True), lambda: side(False), args.pairs, show, args.smoke)
