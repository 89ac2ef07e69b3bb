"""Loading a model from ComfyUI component files against its diffusers folder (issue 35): load time, and the memory
an fp8 scaled transformer file keeps against a bf16 one.

    python bench/model_files.py [--pairs 3]
    python bench/model_files.py --smoke            # the tiny model, one pair: checks the bench runs

A Flux of the stage_memory bench's size (width 1024, 10 double + 20 single blocks, 0.70 B parameters) is written as a
diffusers folder and as ComfyUI files (the BFL transformer under ``model.diffusion_model.``, float32 like the folder's
weights), and its transformer file quantized as ComfyUI's fp8 scaled. Each measurement is a fresh process that loads
the transformer whole in bfloat16 (``load_diffusion_model``) while a thread samples its anonymous RSS every 5 ms; an
idle process that imported the same libraries gives the baseline. The sides alternate in pairs (folder, file, fp8;
then the reverse order), and each ratio is the median of the per-pair ratios with their spread.

Targets: load time single file / folder <= 1.1; model memory of the fp8 scaled base / the bf16 base <= 0.55.
(Per-rank memory with 1 and 2 stages from a single file: ``python bench/stage_memory.py --model flux-files``.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, threading, time
import torch
from diffpipe_core.engine.memory_report import rss_anon
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.plugin import plugin
from diffusers import FluxTransformer2DModel  # noqa: F401  (imports are not what is timed)
import diffpipe_core.component_files, diffpipe_flux.bfl, safetensors.torch  # noqa: F401,E401
keys = json.loads(sys.argv[1])
peak = [rss_anon()]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.005)
base = rss_anon()
if keys:
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    model = plugin.load_diffusion_model(FluxConfig(type="flux", **keys), torch.device("cpu"), torch.bfloat16)
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
else:
    seconds, held = 0.0, 0
print(json.dumps({"seconds": seconds, "peak": max(peak[0], rss_anon()) - base, "held": held}))
"""


def write(root: Path, big: bool) -> dict[str, dict]:
    """The folder, the ComfyUI files and the fp8 scaled file; returns each side's ``[model]`` keys."""
    from diffpipe_core.parts.ldm import vae_table
    from diffpipe_core.testing.component_files import config_only, quantize_file, write_component_files
    from diffpipe_flux.bfl import layout_for_config
    from diffpipe_flux.testing import TinyFluxConfig, tiny_pipeline

    size = dict(num_layers=10, num_single_layers=20, num_attention_heads=8, attention_head_dim=128)
    folder = root / "model"
    tiny_pipeline(TinyFluxConfig(**size, axes_dims_rope=(16, 56, 56)) if big else TinyFluxConfig()).save_pretrained(
        folder, safe_serialization=True
    )
    config = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    files = write_component_files(folder, root / "comfy", layout_for_config(config), vae_table(vae, ""))
    configs = config_only(folder, root / "configs")
    fp8 = quantize_file(files["diffusion_model"], root / "comfy" / "dit-fp8_scaled.safetensors", "fp8_scaled")
    return {
        "folder": {"path": str(folder)},
        "file": {"path": str(configs), "diffusion_model": str(files["diffusion_model"])},
        "fp8": {"path": str(configs), "diffusion_model": str(fp8)},
    }


def measure(keys: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(keys)], capture_output=True, text=True, timeout=1200, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(name: str, values: list[float]) -> str:
    return f"{name}: median {statistics.median(values):.3f} (spread {min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs (at least 3)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, one pair")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="diffpipe-model-files-") as tmp:
        sides = write(Path(tmp), big=not args.smoke)
        idle = measure({})
        print(f"idle process: {idle['peak'] / 2**20:.0f} MiB over its start", flush=True)
        rows: dict[str, list[dict]] = {name: [] for name in sides}
        for i in range(1 if args.smoke else max(3, args.pairs)):
            for name in sides if i % 2 == 0 else reversed(list(sides)):
                rows[name].append(measure(sides[name]))
                got = rows[name][-1]
                print(f"pair {i + 1} {name}: {got['seconds']:.2f} s, peak +{got['peak'] / 2**20:.0f} MiB, "
                      f"tensors {got['held'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
        time_ratio = [f["seconds"] / d["seconds"] for f, d in zip(rows["file"], rows["folder"])]
        held_ratio = [q["held"] / f["held"] for q, f in zip(rows["fp8"], rows["file"])]
        peak_ratio = [q["peak"] / f["peak"] for q, f in zip(rows["fp8"], rows["file"])]
        print(summary("load time, single file / folder (target <= 1.1)", time_ratio))
        print(summary("model tensors, fp8 scaled / bf16 (target <= 0.55)", held_ratio))
        print(summary("peak anonymous memory while loading, fp8 scaled / bf16", peak_ratio))


if __name__ == "__main__":
    main()
