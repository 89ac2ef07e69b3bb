"""One rank of the GPU proof's training run (tests/test_cuda_proof.py), on CUDA over NCCL or on the CPU over gloo.

Usage: ``python proof_train_worker.py DEVICE STAGES STEPS OUT_DIR RUN_KEYS MODEL_TYPE=MODEL_FOLDER ...`` with
MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and LOCAL_RANK set; ``RUN_KEYS`` is a JSON object of extra run.toml
keys (``{"blocks_to_swap": 1}``). For each model in turn (one process: the imports and the process group are paid
once) it builds the stage as ``diffpipe train`` does (``build_stage``: per-stage loading, LoRA, memory savers, the
DeepSpeed pipeline engine and the guarded optimizer) and trains ``STEPS`` steps on batches the plugin's own
``encode_batch`` made from seeded random pixels and captions on the CPU, as the cache would hold them, so both
devices train on the same numbers. The datasets cache is left out: HF datasets and pyarrow (55 MB) do not fit in
what a GPU run may carry, and nothing of it runs on a GPU. Rank 0 writes ``OUT_DIR/losses-<MODEL_TYPE>.json``: the
losses and each step's gradient norm.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PLUGINS = {"reference": "diffpipe_reference.plugin", "flux": "diffpipe_flux.plugin:plugin"}
RUN = """
output_dir = "out"
dataset = "dataset.toml"
micro_batch_size_per_gpu = 2
gradient_accumulation_steps = 2
pipeline_stages = {stages}
seed = 5
{keys}
[model]
type = "{model}"
path = "{path}"
dtype = "float32"
[adapter]
rank = 4
alpha = 4
[optimizer]
lr = 3e-3
"""


def cached_batches(plugin: Any, cfg: Any, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches as the cache collates them: the plugin's ``encode_batch`` of seeded pixels and
    captions, on the CPU."""
    from diffpipe_core.types import EncodeBatch

    g = torch.Generator().manual_seed(0)
    encoders = plugin.require("load_encoders", model_config=cfg.model, device=torch.device("cpu"))
    out = []
    for i in range(count):
        pixels = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
        media = plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(pixels=pixels))
        text = plugin.require(
            "encode_batch", encoders=encoders, batch=EncodeBatch(captions=[f"photo {i} a", f"photo {i} b"])
        )
        out.append({**media, **text})
    return out


def train(model: str, folder: str, device: torch.device, stages: int, steps: int, keys: str, out: Path) -> None:
    from diffpipe_core.config import load_config
    from diffpipe_core.engine.stage_build import Layout, build_stage
    from diffpipe_core.testing.sampling import registered
    from diffpipe_core.types import TrainingContext

    module, _, attr = PLUGINS[model].partition(":")
    plugin_module = importlib.import_module(module)
    plugin = registered(getattr(plugin_module, attr) if attr else plugin_module, model)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "dataset.toml").write_text("")  # never read: the batches below stand in for the cache
        run_toml = root / "run.toml"
        run_toml.write_text(RUN.format(stages=stages, keys=keys, model=model, path=folder))
        cfg = load_config(run_toml, plugin.registry)
        layout = Layout(dist.get_rank(), dist.get_world_size(), stages)
        stage = build_stage(cfg, plugin, layout, device, steps)
    gas = cfg.run.gradient_accumulation_steps
    cached = cached_batches(plugin, cfg, steps * gas)
    context = TrainingContext(model_config=cfg.model, loss=cfg.run.loss)
    losses, norms = [], []
    for step in range(steps):
        torch.manual_seed(step)
        micro = [
            plugin.require(
                "prepare_inputs", batch=batch, context=context, generator=torch.Generator().manual_seed(step * gas + i)
            )
            for i, batch in enumerate(cached[step * gas : (step + 1) * gas])
        ]
        stage.guard.start_step()
        losses.append(float(stage.engine.train_batch(data_iter=iter(micro))))
        norms.append(float(stage.guard.grad_norm))
    if dist.get_rank() == 0:
        result = {"losses": losses, "grad_norms": norms, "device": str(device), "world": dist.get_world_size()}
        (out / f"losses-{model}.json").write_text(json.dumps(result))


def main() -> None:
    device_type, stages, steps, out, keys = sys.argv[1:6]
    from diffpipe_core.engine.ds_patches import init_distributed
    from diffpipe_core.quiet import library_prints, quiet_libraries

    quiet_libraries(cuda=device_type == "cuda")
    local = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # compare with the CPU
    device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    with library_prints():
        init_distributed("nccl" if device_type == "cuda" else "gloo")
    extra = "\n".join(f"{k} = {json.dumps(v)}" for k, v in json.loads(keys).items())
    for pair in sys.argv[6:]:
        model, folder = pair.split("=", 1)
        train(model, folder, device, int(stages), int(steps), extra, Path(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
