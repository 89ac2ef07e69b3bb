"""The tests' warm diffpipe server (diffpipe_core.testing.warm_cli): a forked command must behave as a fresh
``python -m diffpipe_core.cli`` does, and a timeout must leave nothing running."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from test_train import make_project

from diffpipe_core.testing import warm_cli
from diffpipe_core.testing.processes import cli_env, kill_group, run_diffpipe, start_diffpipe


def _both(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    warm = run_diffpipe(args, cwd, timeout=120)
    with monkeypatch.context() as patch:
        patch.setenv(warm_cli.FRESH_ENV, "1")
        fresh = run_diffpipe(args, cwd, timeout=120)
    return warm, fresh


def test_a_forked_command_prints_and_exits_as_a_fresh_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert warm_cli.server_for(["models"], cli_env()) is not None
    warm, fresh = _both(["models"], tmp_path, monkeypatch)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "reference" in warm.stdout
    (tmp_path / "run.toml").write_text('output_dir = "out"\ndataset = "missing.toml"\n[model]\ntype = "nope"\n')
    warm, fresh = _both(["validate", "--config", "run.toml"], tmp_path, monkeypatch)
    assert warm.returncode == fresh.returncode == 1
    assert warm.output == fresh.output and "nope" in warm.output


def test_only_what_is_read_at_run_time_shares_a_server() -> None:
    base = cli_env()
    key = warm_cli._import_time_env
    assert key(base) == key({**base, "OMP_NUM_THREADS": "2", "DIFFPIPE_DEBUG": "1", "PYTEST_CURRENT_TEST": "x"})
    node = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert key(base) == key({**base, **node})  # an external launcher's node: its rank is read as the command starts
    for read_at_import in ("HF_HOME", "TRANSFORMERS_VERBOSITY", "DIFFPIPE_VERBOSE"):
        assert key(base) != key({**base, read_at_import: "elsewhere"}), read_at_import
    assert warm_cli.server_for(["train", "--verbose"], base) is None  # the server silenced the libraries


def test_plugin_folders_on_pythonpath_join_the_childs_path_unless_they_shadow_the_servers_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugins, shadow = tmp_path / "plugins", tmp_path / "shadow"
    for folder, module in ((plugins, "my_diffpipe_plugin"), (shadow, "torch")):
        folder.mkdir()
        (folder / f"{module}.py").write_text("")
    env = cli_env([plugins])
    assert warm_cli._extra_paths(env) == [str(plugins)]
    assert warm_cli.server_for(["models"], env) is warm_cli.server_for(["models"], cli_env())  # one server
    assert warm_cli.server_for(["models"], cli_env([shadow])) is None  # a fresh process imports this torch
    monkeypatch.setenv("PYTHONPATH", "/ours")
    assert warm_cli.server_for(["models"], {**cli_env(), "PYTHONPATH": "/elsewhere"}) is None  # not before ours


def test_a_timeout_kills_the_forked_command_and_its_workers(tmp_path: Path) -> None:
    config = make_project(tmp_path, stages=2, max_steps=10_000, ckpt=100_000)
    with pytest.raises(TimeoutError, match="ran past 8s"):
        run_diffpipe(["train", "--config", str(config), "--num-procs", "2"], tmp_path, timeout=8)
    deadline = time.monotonic() + 10  # SIGKILL is sent; the processes go as the kernel gets to them
    while (left := _running_in(tmp_path.resolve())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes still running in {tmp_path}: {left}"


def _running_in(folder: Path) -> list[str]:
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and _cwd(pid) == folder]


def _cwd(pid: str) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def test_a_started_command_runs_beside_others_and_dies_with_its_group(tmp_path: Path) -> None:
    config = make_project(tmp_path, stages=2, max_steps=10_000, ckpt=100_000)
    proc = start_diffpipe(["train", "--config", str(config), "--num-procs", "2"], tmp_path)
    try:
        assert isinstance(proc, warm_cli.WarmProcess) and proc.poll() is None
        assert "reference" in run_diffpipe(["models"], tmp_path, timeout=60).stdout  # the server is not busy
        assert proc.poll() is None
    finally:
        kill_group(proc)
    proc.communicate(timeout=30)
    assert proc.returncode == -9
