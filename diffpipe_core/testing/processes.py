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
import time
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


def wait_for_file(
    path: Path, proc: subprocess.Popen | warm_cli.WarmProcess, timeout: float = 300, what: str = ""
) -> None:
    """Wait for an event the command (or a test plugin in it) marks by writing ``path``: a step reached, a worker
    ready. Fails, with the end of the command's output, if the command ends first or ``timeout`` seconds pass (a
    safety net, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            ended = f"the command ended first (code {proc.returncode})"
            raise AssertionError(f"{what or path}: {ended}\n{(out + err)[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or path}: not within {timeout:g}s")
        time.sleep(0.05)


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


def run_ranks(
    argv: list[str], envs: list[dict[str, str]], out: Path, timeout: float = 90, grace: float = 5
) -> list[int | None]:
    """Start one process of ``argv`` per environment in ``envs`` (a rank each: ``local_rank_env``), each in its
    own session with its output in ``out/log<rank>.txt``, and wait for all; return their exit codes (None: killed
    while blocked). When a rank fails the others get ``grace`` seconds to notice before every process group is
    killed; a run past ``timeout`` seconds is killed and raises TimeoutError with the logs' tails."""
    out.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        for rank, env in enumerate(envs):
            with open(out / f"log{rank}.txt", "w") as log:  # the child keeps its own copy
                pipes = {"stdout": log, "stderr": subprocess.STDOUT}
                procs.append(subprocess.Popen(argv, cwd=out, env=env, start_new_session=True, **pipes))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.1)
        else:
            if all(p.poll() is None for p in procs):
                logs = "\n".join((out / f"log{r}.txt").read_text()[-3000:] for r in range(len(procs)))
                raise TimeoutError(f"{argv} ran past {timeout}s\n{logs}")
        return [p.poll() for p in procs]
    finally:
        for p in procs:
            kill_group(p)
            p.wait()


#: a generic plugin pausing rank 0 after a step (:func:`paused_at`)
PAUSE_PLUGIN = """
import signal
import time
from pathlib import Path

from diffpipe_core import hookimpl

STEP, MODE, MARK = {step}, {mode!r}, Path({mark!r})


@hookimpl
def on_train_step_end(step, metrics):
    # rank 0, after the step's metrics are written, before its checkpoint; the other ranks wait for it
    if step != STEP:
        return
    if MODE == "hold":  # until the test kills the run
        MARK.touch()
        while True:
            time.sleep(1)
    # "signal": until this worker has the SIGTERM the test sends the launcher (which passes it on)
    got, handler = [], signal.getsignal(signal.SIGTERM)

    def noted(signum, frame):
        got.append(signum)
        handler(signum, frame)

    signal.signal(signal.SIGTERM, noted)
    MARK.touch()
    while not got:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, handler)
"""


def paused_at(root: Path, step: int, mode: str, **env: str) -> tuple[dict[str, str], Path]:
    """The environment of a run whose rank 0 pauses after ``step`` (``hold``: for good; ``signal``: until it has a
    SIGTERM), and the file it writes when it pauses: the fault lands there, however fast the machine. ``env``: more
    variables for the run (:func:`cli_env`)."""
    mark = root / f"paused-at-{step}"
    source = PAUSE_PLUGIN.format(step=step, mode=mode, mark=str(mark))
    site = write_plugin_distribution(root / "site", "diffpipe-pause", {"diffpipe.plugins": {"pause": "pause_at"}},
                                     {"pause_at": source})  # fmt: skip
    return cli_env([site], **env), mark


def killed_and_resumed(root: Path, config: Path | str, procs: int, kill_after: int, timeout: float = 500,
                       **env: str) -> tuple[Path, str]:
    """``diffpipe train --config CONFIG --num-procs PROCS`` in ``root``, every process SIGKILLed once rank 0 has
    logged step ``kill_after``, then the same command with ``--resume`` run to its end. Returns the run folder and
    what the resume printed."""
    before = {p.parent for p in Path(root).rglob("run_info.json")}
    env_run, mark = paused_at(Path(root), kill_after, "hold", **env)
    args = ["train", "--config", str(config), "--num-procs", str(procs)]
    proc = start_diffpipe(args, cwd=Path(root), env=env_run)
    try:
        wait_for_file(mark, proc, what=f"training reaching step {kill_after}", timeout=timeout)
    finally:
        kill_group(proc)  # SIGKILL to the launcher and every worker
        proc.communicate()
    result = run_diffpipe([*args, "--resume"], cwd=Path(root), timeout=timeout, env=cli_env(**env))
    assert result.returncode == 0, result.output[-4000:]
    made = [p.parent for p in Path(root).rglob("run_info.json") if p.parent not in before]
    assert len(made) == 1 and "resuming run" in result.output, (made, result.output[-4000:])
    return made[0], result.output
