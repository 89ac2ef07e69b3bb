"""Acceptance 3: two processes (torch.distributed, gloo) cache disjoint halves and both read the whole cache."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import diffpipe_reference.plugin as reference_plugin
from diffpipe_core.data import prepare_cache
from diffpipe_core.data.cache_store import list_shards
from diffpipe_core.registry import Registry
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_reference.model import write_tiny_model

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    import diffpipe_reference.plugin as reference_plugin
    from diffpipe_core import hookimpl
    from diffpipe_core.data import prepare_cache
    from diffpipe_core.registry import Registry

    class Counter:
        def __init__(self):
            self.captions, self.media = [], 0

        @hookimpl(wrapper=True)
        def encode_batch(self, encoders, batch):
            if batch.captions is not None:
                self.captions += batch.captions
            if batch.pixels is not None:
                self.media += batch.pixels.shape[0]
            return (yield)

    toml, model_dir, out_dir = map(Path, sys.argv[1:4])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    registry = Registry()
    registry.register_model("reference", reference_plugin)
    counter = Counter()
    registry.register_generic("counter", counter)
    plugin = registry.model("reference")
    config = plugin.spec.config_schema(type="reference", path=model_dir)
    ds = prepare_cache(toml, plugin, config, rank=rank, world_size=world, barrier=dist.barrier,
                       batch_size=2, decode_workers=0, progress=False)
    tensors = {}
    for group in ds.groups():
        batch = ds.collate(group, torch.Generator().manual_seed(0))
        for j, sample_id in enumerate(ds.sample_ids(group)):
            for key, value in batch.items():
                tensors[f"{sample_id}/{key}"] = value[j].contiguous()
    save_file(tensors, str(out_dir / f"rank{rank}.safetensors"))
    report = {"captions": counter.captions, "media": counter.media, "summary": ds.summary}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(script: Path, args: list[str], world: int, timeout: float) -> None:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"caching ranks did not finish within {timeout}s") from None
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out[-4000:]}"


def test_two_processes_cache_disjoint_halves_and_read_everything(tmp_path: Path):
    n = 6
    write_image_dataset(tmp_path / "data", n, size=[(64, 64)] * 3 + [(96, 48)] * 3)
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "data", resolutions=[64], enable_ar_bucket=True)
    model_dir = write_tiny_model(tmp_path / "model")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    _run_ranks(script, [str(toml), str(model_dir), str(tmp_path)], world=2, timeout=240)

    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Disjoint halves: each process encoded 3 images and 3 captions, and no caption twice.
    assert [r["media"] for r in reports] == [3, 3]
    assert [r["summary"]["encoded_media"] for r in reports] == [3, 3]
    captions = [set(r["captions"]) for r in reports]
    assert len(captions[0]) == len(captions[1]) == 3 and not captions[0] & captions[1]
    assert captions[0] | captions[1] == {f"caption {i}" for i in range(n)}

    # Both read the whole cache, and the same tensors.
    tensors = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert len(tensors[0]) == 2 * n and sorted(tensors[0]) == sorted(tensors[1])
    for key in tensors[0]:
        assert torch.equal(tensors[0][key], tensors[1][key]), key

    # A later single process finds everything cached.
    registry = Registry()
    registry.register_model("reference", reference_plugin)
    plugin = registry.model("reference")
    config = plugin.spec.config_schema(type="reference", path=model_dir)
    ds = prepare_cache(toml, plugin, config, decode_workers=0, progress=False)
    assert ds.summary["encoded_media"] == 0 and ds.summary["reused_media"] == n and len(ds) == n


ONE_RUN = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path

    import diffpipe_reference.plugin as reference_plugin
    from diffpipe_core import hookimpl
    from diffpipe_core.data import prepare_cache
    from diffpipe_core.registry import Registry

    toml, model_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

    class HeldCounter:  # the first run's encoder waits for the test's go, so the second starts while it encodes
        media = 0

        @hookimpl(wrapper=True)
        def encode_batch(self, encoders, batch):
            (out.parent / "encoding").touch()
            deadline = time.monotonic() + 120
            while not (out.parent / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if batch.pixels is not None:
                self.media += batch.pixels.shape[0]
            return (yield)

    registry = Registry()
    registry.register_model("reference", reference_plugin)
    counter = HeldCounter()
    registry.register_generic("counter", counter)
    plugin = registry.model("reference")
    config = plugin.spec.config_schema(type="reference", path=model_dir)
    ds = prepare_cache(toml, plugin, config, batch_size=2, decode_workers=0, progress=False)
    out.write_text(json.dumps({"media": counter.media, "summary": ds.summary, "items": len(ds)}))
    """
)


def test_two_runs_caching_the_same_dataset_at_once_encode_it_once(tmp_path: Path):
    """Issue 20.15: the second run waits for the first's entries and reuses them, saying why it waits."""
    n = 4
    write_image_dataset(tmp_path / "data", n, size=(64, 64))
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "data", resolutions=[64])
    model_dir = write_tiny_model(tmp_path / "model")
    script = tmp_path / "one_run.py"
    script.write_text(ONE_RUN)

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(toml), str(model_dir), str(tmp_path / name)],
                                start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = start("first.json")
    second = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "encoding").exists():  # the first run holds its turn, encoding
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.05)
        second = start("second.json")
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in second.stdout], daemon=True).start()
        said = []
        while not any("waiting for it" in line for line in said):  # the second says it waits, and why
            said.append(lines.get(timeout=120))
        (tmp_path / "go").touch()
        first_out = first.communicate(timeout=240)[0]
        second.wait(timeout=240)
    finally:
        (tmp_path / "go").touch()
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert first.returncode == 0 and second.returncode == 0, first_out[-3000:]
    assert f"{tmp_path / 'cache' / 'reference' / 'dataset'}" in said[-1] and "pid" in said[-1], said
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("first.json", "second.json"))
    assert one["media"] == n and two["media"] == 0, (one, two)
    assert two["summary"]["reused_media"] == n and two["items"] == n
    fp_dir = next(p for p in (tmp_path / "cache" / "reference").glob("*/*") if (p / "media").is_dir())
    stored = [k for shard in list_shards(fp_dir / "media") for k in shard.keys]
    assert len(stored) == len(set(stored)) == n  # each entry stored once
