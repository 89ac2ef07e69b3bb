"""One training process: ``python -m diffpipe_core.engine.worker`` (started by the launcher).

Joins the process group, caches its share of the dataset, frees the encoders, then trains. With
``--sample-request`` (``diffpipe sample``) it builds a forward-only pipeline engine instead and samples once,
without the dataset (:mod:`diffpipe_core.sampling.worker`).
"""

from __future__ import annotations

import argparse
import gc
import os
import traceback
from pathlib import Path

import torch

from diffpipe_core.engine.launcher import PEER_FAILED, is_peer_failure, report_error


def describe_failure(exc: BaseException, debug: bool) -> tuple[str, str]:
    """``(one-line message, detail)`` of a worker's error: what the user's files and settings cause, or the
    machine does to a decode worker, needs no traceback (``--debug`` adds it); a bug keeps its traceback."""
    from diffpipe_core.data.cache import CacheError
    from diffpipe_core.data.scan import DatasetError
    from diffpipe_core.schema import ConfigError

    user_errors = (ValueError, OSError, KeyError, FloatingPointError, CacheError, DatasetError, ConfigError)
    message = f"{type(exc).__name__}: {exc}"
    expected = isinstance(exc, user_errors)
    if isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker"):
        expected = True  # killed (or out of memory) while decoding; torch adds a long chained traceback
        first = str(exc).strip().splitlines()[0]
        message = (f"a decode worker died: {first} It was killed or ran out of memory (fewer decode workers: "
                   "DIFFPIPE_DECODE_WORKERS=N); caching resumes where it stopped")
    return message, "" if expected and not debug else "".join(traceback.format_exception(exc))


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _backend() -> str:
    """Our launcher says which; under another launcher NCCL on GPUs, gloo on CPUs."""
    return os.environ.get("DIFFPIPE_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")


def _shared_new_run(cfg: object, rank: int, world: int) -> str:
    """Rank 0 creates the run folder (on storage every node sees) and tells the other ranks its path."""
    import torch.distributed as dist

    from diffpipe_core.engine.run_dir import start_run

    path = [str(start_run(cfg, world)) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if rank == 0:
        print(f"diffpipe: run folder {path[0]}", flush=True)
    return str(path[0])


def _cache_and_train(args: argparse.Namespace, cfg, plugin, device: torch.device, rank: int, world: int) -> None:
    """Cache this rank's share of the datasets, free the encoders, then (unless ``--cache-only``) train."""
    import torch.distributed as dist

    from diffpipe_core.data import prepare_cache

    def cache(dataset_toml: Path):
        return prepare_cache(
            dataset_toml,
            plugin,
            cfg.model,
            rank=rank,
            world_size=world,
            barrier=dist.barrier,
            device=device,
            batch_size=cfg.run.caching_batch_size,
            regenerate=args.regenerate,
            strict=args.strict,
            trust_cache=args.trust_cache,
            progress=rank == 0,
            prune=args.prune,
            report_skipped=not args.scanned,
        )

    dataset = cache(cfg.run.dataset)
    eval_datasets = {ev.name: cache(ev.config) for ev in cfg.run.eval_datasets}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.cache_only:
        return
    from diffpipe_core.engine.trainer import Trainer
    from diffpipe_core.sampling.worker import prepare_sampling

    if args.new_run:
        args.run_dir = _shared_new_run(cfg, rank, world)
    sampling = prepare_sampling(cfg, plugin, device)  # prompts encoded now, once
    run_dir = Path(args.run_dir) if args.run_dir else Path.cwd()
    trainer = Trainer(cfg, plugin, dataset, run_dir, device, eval_datasets)
    if sampling is not None:
        sampling.attach(trainer)
    trainer.train(Path(args.resume_from) if args.resume_from else None, args.reset_optimizer, args.reset_dataloader)


def main(argv: list[str] | None = None) -> int:
    """Run one worker; its exit code (128 + the signal when SIGTERM or Ctrl-C stopped it)."""
    from diffpipe_core.engine import stopping

    stopping.install()  # SIGTERM / Ctrl-C: stop quietly now, or after the step while training
    try:
        return _main(argv)
    except stopping.Stopped as stop:  # before training (or after it): nothing to save
        return stop.code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="diffpipe-worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--model")
    parser.add_argument("--run-dir")
    parser.add_argument("--new-run", action="store_true", help="rank 0 creates the run folder (external launcher)")
    parser.add_argument("--resume-from")
    parser.add_argument("--reset-optimizer", action="store_true", help="resume the weights with a fresh optimizer")
    parser.add_argument("--reset-dataloader", action="store_true", help="resume with the epoch's data order restarted")
    parser.add_argument("--cache-only", action="store_true")
    parser.add_argument("--regenerate", action="store_true")
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--trust-cache", action="store_true")
    parser.add_argument("--prune", action="store_true")
    parser.add_argument("--scanned", action="store_true", help="the command's scan already warned about left-out files")
    parser.add_argument("--sample-request", help="diffpipe sample: a JSON file with the prompts and output")
    args = parser.parse_args(argv)

    from diffpipe_core.engine import stopping
    from diffpipe_core.quiet import library_prints, log_through_bars, quiet_libraries

    quiet_libraries(cuda=torch.cuda.is_available())
    import torch.distributed as dist

    from diffpipe_core.engine import ds_patches

    quiet_libraries()  # again: importing DeepSpeed set its logger's level
    log_through_bars()

    from diffpipe_core.config import load_config
    from diffpipe_core.registry import get_registry

    ds_patches.use_environment_extensions_dir()
    ds_patches.guard_op_builds()
    backend = _backend()
    if backend == "gloo":
        from diffpipe_core.engine.gloo_interface import choose_gloo_interface

        choose_gloo_interface()  # workers on other machines must reach this one's address, not its loopback
    with library_prints():
        ds_patches.init_distributed(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    code, agreed = 0, False
    try:
        registry = get_registry()
        purpose = "sample" if args.sample_request else "train"
        cfg = load_config(args.config, registry, model_override=args.model, purpose=purpose)
        plugin = registry.model(cfg.model_name)
        device = _device()
        if args.sample_request:
            from diffpipe_core.sampling.worker import run_sample_request

            run_sample_request(cfg, plugin, device, args.sample_request)  # no dataset, no cache
        else:
            _cache_and_train(args, cfg, plugin, device, rank, world)
    except stopping.Stopped as stop:  # while training, every rank checkpointed the same step (agreed)
        code, agreed = stop.code, stop.agreed
    except Exception as exc:  # the launcher prints the first failing rank's error, once, after all stopped
        debug = bool(os.environ.get("DIFFPIPE_DEBUG"))
        if is_peer_failure(exc):
            code = PEER_FAILED  # another rank died first; its error is the one that matters
            if debug:
                traceback.print_exc()
        else:
            report_error(rank, *describe_failure(exc, debug))
            code = 1
    stopping.uninstall()
    if code == 0 or agreed:
        dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    from diffpipe_core.engine.fast_exit import exit_now

    exit_now(main())
