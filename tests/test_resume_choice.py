"""Issue 20.3, 20.4, 20.5, 20.19: which checkpoint ``--resume`` continues from, checked before any worker starts.
Checkpoints are written by the real writer (one rank), then damaged the ways a crash or a disk does it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffpipe_core.engine import checkpoint as ckpt
from diffpipe_core.engine.run_dir import resolve_resume


def write(run: Path, step: int, value: float = 1.0, keep: int = 3) -> Path:
    if not (run / "run_info.json").exists():
        run.mkdir(parents=True, exist_ok=True)
        (run / "run_info.json").write_text("{}")
    return ckpt.write_checkpoint(
        run, step, rank=0, stage_id=0, dp_rank=0,
        params={"blocks.0.lora_A.weight": torch.full((4, 8), value), "blocks.0.lora_B.weight": torch.zeros(8, 4)},
        optimizer_state={"optimizer": {"state": {}, "param_groups": []}, "scheduler": {"last_epoch": step}},
        train_state={"step": step, "micro_index": step, "pipeline_stages": 1, "world_size": 1, "total_steps": 8},
        keep=keep, barrier=lambda: None,
    )  # fmt: skip


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def empty(file: Path) -> None:
    file.write_bytes(b"")


def missing(file: Path) -> None:
    file.unlink()


@pytest.mark.parametrize("damage", [truncate, empty, missing])
@pytest.mark.parametrize("name", ["params-stage0.safetensors", "optimizer-stage0.pt", "train_state.json"])
def test_a_damaged_newest_checkpoint_gives_way_to_the_previous_one(tmp_path: Path, damage, name: str) -> None:
    run = tmp_path / "out" / "20250101-000000"
    write(run, 2)
    newest = write(run, 4)
    damage(newest / name)
    chosen = resolve_resume(tmp_path / "out", "latest")
    assert chosen.checkpoint == run / "checkpoints" / "step-0000002"
    assert len(chosen.notes) == 1 and "checkpoint step-0000004 is damaged" in chosen.notes[0]
    assert str(newest / name) in chosen.notes[0], chosen.notes  # names the file
    # named outright, the damaged one is refused, naming the file
    with pytest.raises(FileNotFoundError, match=f"{newest / name}"):
        resolve_resume(tmp_path / "out", str(newest))


def test_reading_a_damaged_file_names_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    newest = write(run, 2)
    truncate(newest / "params-stage0.safetensors")
    truncate(newest / "optimizer-stage0.pt")
    with pytest.raises(ckpt.CheckpointError, match=f"{newest / 'params-stage0.safetensors'}: cannot be read"):
        ckpt.read_params(newest)
    with pytest.raises(ckpt.CheckpointError, match=f"{newest / 'optimizer-stage0.pt'}: cannot be read"):
        ckpt.read_optimizer_state(newest, 0)
    empty(newest / "train_state.json")
    with pytest.raises(ckpt.CheckpointError, match=f"{newest / 'train_state.json'}: cannot be read"):
        ckpt.read_train_state(newest)


def test_zeroed_or_nan_tensor_bytes_behind_a_valid_header_are_caught(tmp_path: Path) -> None:
    run = tmp_path / "out" / "run"
    write(run, 2)
    newest = write(run, 4, value=3.0)
    file = newest / "params-stage0.safetensors"
    data = bytearray(file.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header : header + 16] = torch.full((4,), float("nan")).numpy().tobytes()  # same size, header intact
    file.write_bytes(bytes(data))
    assert torch.isnan(ckpt.read_params(newest)["blocks.0.lora_A.weight"]).any()  # it still loads
    chosen = resolve_resume(tmp_path / "out", "latest")
    assert chosen.checkpoint.name == "step-0000002"
    assert f"{file}: its content does not match its checksum" in chosen.notes[0]
    sums = json.loads((newest / "checksums.json").read_text())
    assert set(sums) == {"params-stage0.safetensors", "optimizer-stage0.pt", "train_state.json"}


def test_latest_naming_a_missing_folder_resumes_the_newest_run_not_an_older_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write(out / "20250101-000000", 6)  # an older run, complete
    newer = out / "20250102-000000"
    write(newer, 2)
    write(newer, 4)
    (newer / "checkpoints" / "latest").write_text("step-0000006")  # a checkpoint since deleted
    chosen = resolve_resume(out, "latest")
    assert chosen.run_dir == newer and chosen.checkpoint.name == "step-0000004"
    assert chosen.notes == (f"{newer / 'checkpoints' / 'latest'} names step-0000006, which is missing",)
    for step in ("step-0000002", "step-0000004"):
        missing(newer / "checkpoints" / step / "checksums.json")
    with pytest.raises(FileNotFoundError) as info:
        resolve_resume(out, "latest")  # nothing whole in the newest run: refused, naming what is missing
    message = str(info.value)
    assert f"no complete checkpoint in {newer}" in message and "step-0000004" in message
    assert f"{newer / 'checkpoints' / 'step-0000002' / 'checksums.json'}: missing" in message


def test_a_bare_run_name_is_looked_up_in_output_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    write(out / "20250101-000000", 2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    chosen = resolve_resume(out, "20250101-000000")
    assert chosen.run_dir == out / "20250101-000000" and chosen.checkpoint.name == "step-0000002"
    with pytest.raises(FileNotFoundError, match=f"no {out / 'nope'} nor {elsewhere / 'nope'}"):
        resolve_resume(out, "nope")


@pytest.mark.parametrize("where", ["params", "optimizer"])
def test_a_nonfinite_checkpoint_with_valid_checksums_gives_way_to_the_newest_finite_one(
    tmp_path: Path, where: str
) -> None:
    """Issue 37.3: written whole (checksums match) but holding NaN: named, and the previous checkpoint used."""
    run = tmp_path / "out" / "run"
    write(run, 2)
    if where == "params":
        newest = write(run, 4, value=float("nan"))
        said = f"{newest / 'params-stage0.safetensors'}: NaN or infinite values in 'blocks.0.lora_A.weight'"
    else:
        newest = ckpt.write_checkpoint(
            run, 4, rank=0, stage_id=0, dp_rank=0,
            params={"blocks.0.lora_A.weight": torch.ones(4, 8), "blocks.0.lora_B.weight": torch.zeros(8, 4)},
            optimizer_state={"optimizer": {"state": {1: {"exp_avg": torch.full((8, 4), float("inf"))}},
                                           "param_groups": []}, "scheduler": {"last_epoch": 4}},
            train_state={"step": 4, "micro_index": 4, "pipeline_stages": 1, "world_size": 1, "total_steps": 8},
            keep=3, barrier=lambda: None,
        )  # fmt: skip
        said = f"{newest / 'optimizer-stage0.pt'}: NaN or infinite values in 'optimizer.state.1.exp_avg'"
    assert not checkpoint_problems_before_finite(newest)  # the checksums hold
    chosen = resolve_resume(tmp_path / "out", "latest")
    assert chosen.checkpoint.name == "step-0000002"
    assert chosen.notes == (f"checkpoint step-0000004 is damaged: {said}",), chosen.notes
    with pytest.raises(FileNotFoundError, match="is damaged: .*NaN or infinite values"):
        resolve_resume(tmp_path / "out", str(newest))


def checkpoint_problems_before_finite(folder: Path) -> list[str]:
    from diffpipe_core.engine import checkpoint_check

    return [p for p in checkpoint_check.checkpoint_problems(folder) if "NaN or infinite" not in p]
