"""Running ``diffpipe`` in a subprocess from tests, and installing throwaway plugins for it.

Every run gets a timeout and its own process group, which is killed whole on timeout, so a hung
worker can never hang the test suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from diffpipe_core.testing import warm_cli


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def cli_env(extra_paths: list[Path] | None = None, **env: str) -> dict[str, str]:
    out = dict(os.environ)
    if extra_paths:
        out["PYTHONPATH"] = os.pathsep.join([*map(str, extra_paths), out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out.setdefault("HF_DATASETS_OFFLINE", "1")
    out.setdefault("HF_HUB_OFFLINE", "1")
    out.update(env)
    return out


def start_diffpipe(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, program: Path | None = None
) -> subprocess.Popen | warm_cli.WarmProcess:
    """Start ``python -m diffpipe_core.cli *args`` (or ``program *args``, e.g. another environment's
    ``bin/diffpipe``) in a new session (its own process group); forked from a warm server where that runs it as a
    fresh process would (:mod:`diffpipe_core.testing.warm_cli`). ``stdout`` and ``stderr`` are read with
    ``communicate``."""
    env = env or cli_env()
    if program is None:
        warm = warm_cli.server_for(args, env)
        if warm is not None:
            return warm.start(args, cwd, env)
    return _start_fresh(args, cwd, env, program)


def _start_fresh(args: list[str], cwd: Path, env: dict[str, str], program: Path | None) -> subprocess.Popen:
    command = [str(program)] if program is not None else [sys.executable, "-m", "diffpipe_core.cli"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen([*command, *args], cwd=cwd, env=env, start_new_session=True, **pipes)


def kill_group(proc: subprocess.Popen | warm_cli.WarmProcess) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_diffpipe(
    args: list[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None, program: Path | None = None
) -> CliResult:
    """Run diffpipe to completion; on timeout kill its whole process group and raise. Forked from a warm server
    where that runs it as a fresh process would (:mod:`diffpipe_core.testing.warm_cli`)."""
    env = env or cli_env()
    if program is None:
        warm = warm_cli.server_for(args, env)
        if warm is not None:
            return CliResult(*warm.run(args, cwd, timeout, env))
    proc = _start_fresh(args, cwd, env, program)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise TimeoutError(f"diffpipe {' '.join(args)} ran past {timeout}s\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        kill_group(proc)  # stray workers, if any
    return CliResult(proc.returncode, out, err)


def write_plugin_distribution(
    site: Path, dist_name: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]
) -> Path:
    """Make ``site`` an importable folder holding a real installed distribution: a ``.dist-info`` with
    METADATA, entry_points.txt and the RECORD of its files, plus the given module sources (a dotted name is a module
    of a package: ``"pkg.plugin"`` writes ``pkg/__init__.py`` and ``pkg/plugin.py``). Put ``site`` on PYTHONPATH to
    use it. Two distributions written into one ``site`` may share a package, as pip would let them."""
    site.mkdir(parents=True, exist_ok=True)
    files = []
    for name, source in modules.items():
        *package, module = name.split(".")
        folder = site.joinpath(*package)
        folder.mkdir(parents=True, exist_ok=True)
        for depth in range(1, len(package) + 1):
            init = site.joinpath(*package[:depth], "__init__.py")
            init.touch()
            files.append(init.relative_to(site).as_posix())
        (folder / f"{module}.py").write_text(textwrap.dedent(source))
        files.append((folder / f"{module}.py").relative_to(site).as_posix())
    info = site / f"{dist_name.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.0.1\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in dict.fromkeys(files)))
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site
