"""A crash in the middle of a save leaves the previous checkpoint and adapter usable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig

import diffpipe_core.atomic as atomic
from diffpipe_core.adapters import read_adapter
from diffpipe_core.engine import checkpoint as ckpt
from diffpipe_core.engine.run_dir import latest_checkpoint, resolve_resume
from diffpipe_core.engine.saving import write_adapter
from diffpipe_core.registry import get_registry


def write(run: Path, step: int, value: float) -> Path:
    return ckpt.write_checkpoint(
        run,
        step,
        rank=0,
        stage_id=0,
        dp_rank=0,
        params={"w": torch.full((2,), value)},
        optimizer_state={"state": {}, "lr": 0.1},
        train_state={"step": step, "micro_index": step},
        keep=2,
        barrier=lambda: None,
    )


def test_crash_during_checkpoint_keeps_the_previous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, 2, 1.0)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ckpt, "atomic_write_bytes", crash)
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path, 4, 2.0)
    monkeypatch.undo()
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-0000002"
    assert torch.equal(ckpt.read_params(latest)["w"], torch.full((2,), 1.0))
    chosen = resolve_resume(tmp_path.parent, str(tmp_path))
    assert (chosen.run_dir, chosen.checkpoint, chosen.notes) == (tmp_path, latest, ())
    # the next good write replaces the leftover and prunes beyond keep=2
    write(tmp_path, 6, 3.0)
    write(tmp_path, 8, 4.0)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-0000006", "step-0000008"]
    assert ckpt.read_train_state(latest_checkpoint(tmp_path))["step"] == 8


def test_crash_during_adapter_save_keeps_the_previous_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = get_registry().model("reference")
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"])
    state = {"blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 4), "blocks.0.attn.to_q.lora_B.weight": torch.ones(4, 2)}
    out = tmp_path / "saved" / "final"
    write_adapter(out, state, plugin, config, ["diffusers"], torch.float32)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    newer = {k: v * 5 for k, v in state.items()}
    monkeypatch.setattr(atomic, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        write_adapter(out, newer, plugin, config, ["diffusers"], torch.float32)
    monkeypatch.undo()
    kept, _ = read_adapter(out)
    assert torch.equal(kept["transformer.blocks.0.attn.to_q.lora_A.weight"], torch.ones(2, 4))


def test_atomic_write_leaves_old_content_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f.txt"
    atomic.atomic_write_text(target, "old")

    def boom(*args, **kwargs):
        raise OSError("no space")

    monkeypatch.setattr(atomic.os, "fsync", boom)
    with pytest.raises(OSError):
        atomic.atomic_write_text(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_saved_files_get_the_umask_permissions(tmp_path: Path, umask: int) -> None:
    """Issue 9.8: a saved LoRA (and every other atomic write) is readable as the user's umask allows,
    not 0600 as a temporary file from mkstemp would leave it."""
    import os

    from safetensors.torch import save_file

    plugin = get_registry().model("reference")
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"])
    state = {"blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 4), "blocks.0.attn.to_q.lora_B.weight": torch.ones(4, 2)}
    old = os.umask(umask)
    try:
        assert atomic.current_umask() == umask
        write_adapter(tmp_path / "final", state, plugin, config, ["diffusers"], torch.float32)
        atomic.atomic_write_bytes(tmp_path / "blob.bin", b"x")
        export = tmp_path / ".tmp-export"  # a folder a library wrote (safetensors' own files are 0600)
        export.mkdir()
        save_file({"w": torch.ones(1)}, str(export / "model.safetensors"))
        atomic.replace_dir(export, tmp_path / "export")
    finally:
        os.umask(old)
    files = [*(tmp_path / "final").iterdir(), tmp_path / "blob.bin", tmp_path / "export" / "model.safetensors"]
    assert len(files) >= 4
    for file in files:
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file
