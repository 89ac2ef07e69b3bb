"""One training process: ``python -m diffpipe_core.engine.worker`` (started by the launcher).

Joins the process group, caches its share of the dataset, frees the encoders, then trains.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from pathlib import Path

import torch


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diffpipe-worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--model")
    parser.add_argument("--run-dir")
    parser.add_argument("--resume-from")
    parser.add_argument("--cache-only", action="store_true")
    parser.add_argument("--regenerate", action="store_true")
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--trust-cache", action="store_true")
    args = parser.parse_args(argv)

    import deepspeed
    import torch.distributed as dist

    from diffpipe_core.config import load_config
    from diffpipe_core.data import prepare_cache
    from diffpipe_core.registry import get_registry

    deepspeed.init_distributed(dist_backend=os.environ.get("DIFFPIPE_BACKEND", "gloo"), verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    code = 0
    try:
        registry = get_registry()
        cfg = load_config(args.config, registry, model_override=args.model)
        plugin = registry.model(cfg.model_name)
        device = _device()

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
            )

        dataset = cache(cfg.run.dataset)
        eval_datasets = {ev.name: cache(ev.config) for ev in cfg.run.eval_datasets}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.cache_only:
            from diffpipe_core.engine.trainer import Trainer

            trainer = Trainer(cfg, plugin, dataset, Path(args.run_dir), device, eval_datasets)
            trainer.train(Path(args.resume_from) if args.resume_from else None)
    except Exception as exc:  # report once per rank, then fail the launch
        print(f"diffpipe: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        expected = isinstance(exc, (ValueError, FileNotFoundError, FloatingPointError))
        if os.environ.get("DIFFPIPE_DEBUG") or not expected:
            traceback.print_exc()
        code = 1
    if code == 0:
        dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
