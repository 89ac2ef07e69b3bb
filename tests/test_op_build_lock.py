"""The wait for another process's DeepSpeed op build (diffpipe_core.engine.ds_patches, patch 6), in-process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from diffpipe_core.engine import ds_patches


def test_a_released_lock_ends_the_wait_after_one_notice(tmp_path: Path) -> None:
    """The wait says once what it waits for, and ends when the lock goes (here: released once the notice is out)."""
    lock = tmp_path / "op" / "lock"
    lock.parent.mkdir()
    lock.touch()
    said: list[str] = []

    def say(line: str) -> None:
        assert lock.exists()  # said while the lock is held
        said.append(line)
        lock.unlink()  # the holder's build ends

    ds_patches.wait_for_build_lock("some_op", lock, timeout=120, notice_after=0.2, say=say)  # 120 s: a safety net
    assert not lock.exists()
    assert len(said) == 1 and f"some_op op build waits for the lock {lock}" in said[0], said


def test_the_notice_is_said_once_however_long_the_wait(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    said: list[str] = []
    with pytest.raises(ds_patches.OpBuildLockTimeout):  # the timeout ends the wait: a second or more of polls
        ds_patches.wait_for_build_lock("some_op", lock, timeout=1.0, notice_after=0, say=said.append)
    assert len(said) == 1, said


def test_a_held_lock_names_its_holder_and_times_out(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # what torch's FileBaton does while it builds
    try:
        with pytest.raises(ds_patches.OpBuildLockTimeout) as info:
            ds_patches.wait_for_build_lock("some_op", lock, timeout=0.5, notice_after=10, say=lambda _: None)
    finally:
        os.close(fd)
    message = str(info.value)
    assert f"held by pid {os.getpid()} (" in message and "removed when that build ends" in message, message
    assert "gave up after 0.5s" in message and ds_patches.BUILD_LOCK_TIMEOUT_ENV in message


def test_each_environment_has_its_own_extensions_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(ds_patches.EXTENSIONS_ENV, raising=False)
    ours = ds_patches.environment_extensions_dir()
    monkeypatch.setattr(sys, "prefix", "/opt/another-venv")
    other = ds_patches.environment_extensions_dir()
    assert ours != other and ours.parent == other.parent == tmp_path / "diffpipe" / "torch_extensions"
    ds_patches.use_environment_extensions_dir()
    assert os.environ[ds_patches.EXTENSIONS_ENV] == str(other)
    monkeypatch.setenv(ds_patches.EXTENSIONS_ENV, "/mine")  # the user's choice stands
    ds_patches.use_environment_extensions_dir()
    assert os.environ[ds_patches.EXTENSIONS_ENV] == "/mine"
