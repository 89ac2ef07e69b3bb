"""The workers' memory report (engine/memory_report.py), in one process: what bench/stage_memory.py reads."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed  # noqa: F401  (its deprecated reduce_op object is among the objects the report walks)

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.config import RunConfig
from diffpipe_core.engine import memory_report
from diffpipe_core.engine.stage_costs import weights_only_costs
from diffpipe_core.engine.stage_plan import plan_stages
from diffpipe_reference.model import TinyDiT, TinyDiTConfig


def test_the_report_keeps_the_estimate_through_every_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first phase gives the stage plan's estimate and the live tensors; the later ones (each step, save and
    checkpoint) record the anonymous RSS alone, and the report still carries the estimate."""
    monkeypatch.setenv(memory_report.ENV, str(tmp_path))
    monkeypatch.setattr(memory_report, "_phases", [])
    monkeypatch.setattr(memory_report, "_estimate", {}, raising=False)
    model = TinyDiT(TinyDiTConfig(dim=32, depth=2, heads=2))
    model.requires_grad_(False)
    apply_lora(model, lora_config(4, 4, 0.0, ["to_q"]))
    layers = [model]
    plan = plan_stages(weights_only_costs(layers), RunConfig(model={"type": "tiny"}), 1, False, "-")
    memory_report.record("step 1", 0, model, estimate=plan.stages[0])
    memory_report.record("step 2", 0)
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert [p["phase"] for p in report["phases"]] == ["step 1", "step 2"]
    assert report["estimate"]["peak_bytes"] == plan.stages[0].peak_bytes > 0
    tensors = report["phases"][0]["bytes"]
    lora = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert tensors["trainable weights"] == lora
    assert "bytes" not in report["phases"][1] and report["phases"][1]["rss_anon"] > 0


def test_walking_the_live_tensors_prints_no_third_party_warning() -> None:
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        totals = memory_report.tensor_breakdown(model)["bytes"]
    assert totals["trainable weights"] == 4 * (16 + 4)  # the weight and bias, float32


def test_each_phase_splits_its_peak_into_live_and_kept_heap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 MiB tensor made and freed between two phases: the second phase's peak (the sampler's) saw it, in
    the C heap's live bytes at that moment; the phase's own live bytes, after it was freed, no longer count it."""
    if memory_report.heap() is None:
        pytest.skip("not glibc: no mallinfo2")
    monkeypatch.setenv(memory_report.ENV, str(tmp_path))
    monkeypatch.setattr(memory_report, "_phases", [])
    memory_report.record("before", 0)
    with memory_report._peak_lock:  # and the peak from here: a look of the sampling thread before it (a larger RSS
        memory_report._peak["rss_anon"] = 0  # since returned) would otherwise be the phase's peak, without the tensor
    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # mmapped by malloc: live while it exists
    memory_report.sample_peak()  # the sampling thread's look, made now
    del big  # unmapped at once: the RSS falls by it
    freed = memory_report.rss_anon()
    memory_report.record("after", 0)
    before, after = json.loads((tmp_path / "rank0.json").read_text())["phases"]
    assert after["peak"]["heap_live"] - after["heap_live"] >= 60 * 2**20
    # against the RSS after the free, not before the tensor: other memory the process returns meanwhile (seen in
    # CI: 36 MiB between the base and the tensor's look) only widens this gap
    assert after["peak"]["rss_anon"] - freed >= 60 * 2**20 and before["phase"] == "before"
    assert after["heap_free"] >= 0
