"""Issue 26 end to end, in one 2-process run of the reference model through the real CLI (2 pipeline stages) and its
resume: a LoKr trained per stage with schedule-free AdamW (the diffpipe-optimizers plugin), the attention group
frozen by ``[optimizer] group_lr``, and everything logged to Weights & Biases in offline mode (``WANDB_MODE``).

Resumed from its middle checkpoint, the run repeats every loss and writes the same adapter files, byte for byte.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_train import make_project, run_dirs

from diffpipe_core.engine.run_dir import read_metrics, train_losses
from diffpipe_core.testing.golden import folder_manifest
from diffpipe_core.testing.processes import cli_env, run_diffpipe

pytestmark = pytest.mark.slow

TABLES = """
[logging]
wandb = { project = "diffpipe-tests", tags = ["ci"] }
"""


def saved_files(folder: Path) -> dict[str, Any]:
    """Every safetensors file's metadata and tensor bytes (the header's metadata order differs per process), the
    other files' bytes."""
    other = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix != ".safetensors"}
    return {"safetensors": folder_manifest(folder), "other": other}


def _train(root: Path, config: Path, *args: str) -> str:
    env = cli_env(WANDB_MODE="offline", WANDB_DISABLE_GIT="true")
    result = run_diffpipe(["train", "--config", str(config), "--num-procs", "2", *args], cwd=root, timeout=600, env=env)
    assert result.returncode == 0, result.output[-4000:]
    return result.output


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("users_features")
    config = make_project(root, stages=2, max_steps=4, ckpt=2, tables=TABLES)
    text = config.read_text().replace("dropout = 0.1", 'type = "lokr"\nfactor = 4\nmodule_dropout = 0.1')
    text = text.replace(
        "[optimizer]\nlr = 3e-3",
        '[optimizer]\ntype = "adamw_schedulefree"\nlr = 3e-3\ngroup_lr = { attention = 0.0 }',
    )
    config.write_text(text.replace('lr_scheduler = "cosine"', 'lr_scheduler = "constant"'))
    first_log = _train(root, config)
    [run_dir] = run_dirs(root)
    first = {
        "losses": train_losses(run_dir),
        "files": saved_files(run_dir / "saved" / "final"),
        "wandb_runs": sorted(p.name for p in (run_dir / "wandb" / "wandb").glob("offline-run-*")),
    }
    shutil.copytree(run_dir / "checkpoints" / "step-0000004", root / "uninterrupted-step-4")
    second_log = _train(root, config, "--resume", str(run_dir / "checkpoints" / "step-0000002"))
    return {"root": root, "run": run_dir, "first": first, "logs": (first_log, second_log)}


def test_resume_repeats_losses_and_adapter_files(run: dict[str, Any]) -> None:
    run_dir, first = run["run"], run["first"]
    assert sorted(first["losses"]) == [1, 2, 3, 4]
    assert train_losses(run_dir) == first["losses"]
    assert set(first["files"]["safetensors"]) == {"adapter_model.safetensors"}
    assert saved_files(run_dir / "saved" / "final") == first["files"]
    for stage in (0, 1):
        name = f"params-stage{stage}.safetensors"
        resumed = load_file(str(run_dir / "checkpoints" / "step-0000004" / name))
        uninterrupted = load_file(str(run["root"] / "uninterrupted-step-4" / name))
        assert resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed), stage


def test_per_stage_lokr_group_lr_and_schedulefree_weights(run: dict[str, Any]) -> None:
    run_dir = run["run"]
    saved = load_file(str(run_dir / "saved" / "final" / "adapter_model.safetensors"))
    config = json.loads((run_dir / "saved" / "final" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LOKR" and config["decompose_factor"] == 4 and config["module_dropout"] == 0.1
    w1 = {k: v for k, v in saved.items() if k.endswith(".lokr_w1")}
    blocks = {k.split(".")[2] for k in w1}
    assert len(blocks) > 1  # both pipeline stages' blocks were gathered into the file
    for key, value in w1.items():  # lokr_w1 starts at zero: only the trained (mlp) group moved it
        assert (value.abs().max() == 0) == (".attn." in key), key
    # schedule-free: the file holds the averaged weights (eval mode), not the training point the checkpoint keeps
    params: dict[str, torch.Tensor] = {}
    for file in (run_dir / "checkpoints" / "step-0000004").glob("params-stage*.safetensors"):
        params.update(load_file(str(file)))
    fc1 = next(k for k in saved if ".fc1.lokr_w1" in k)
    y = params[fc1.removeprefix("transformer.") + ".default"]
    assert not torch.allclose(saved[fc1].float(), y.float(), atol=1e-6)


def read_wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``.wandb`` file (W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of
    chunks with a 7-byte header: crc32, length, type = full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    block = 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_got_scalars_and_config_from_rank_0_only(run: dict[str, Any]) -> None:
    run_dir, first = run["run"], run["first"]
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    after = sorted(p.name for p in (run_dir / "wandb" / "wandb").glob("offline-run-*"))
    # one W&B run per start (rank 0 only), the resume continuing the same id
    assert len(first["wandb_runs"]) == 1 and len(after) == 2 and all(n.endswith(run_id) for n in after)
    metrics = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    logged: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    for folder in after:
        for record in read_wandb_records(run_dir / "wandb" / "wandb" / folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "_step" in items:
                    logged.setdefault(items["_step"], {}).update(items)
            elif kind == "run":
                config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.run.config.update}
    assert sorted(logged) == [1, 2, 3, 4], sorted(logged)
    for step, values in logged.items():
        assert values["train/loss"] == pytest.approx(metrics[step]["loss"], rel=1e-6), step
        # the attention group at learning rate 0 is frozen (optim.freeze_zero_lr_groups), not stepped at 0: one
        # optimizer group is left, logged as the run's learning rate
        assert values["train/lr"] == pytest.approx(metrics[step]["lr"]) and "train/lr_attention" not in values
    assert config["run"]["optimizer"]["type"] == "adamw_schedulefree"
    assert config["model"]["type"] == "reference"
    for log in run["logs"]:  # W&B's own messages stay behind --verbose
        assert "wandb" not in log.lower(), log[-3000:]
