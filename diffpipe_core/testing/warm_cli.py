"""Run ``diffpipe`` commands from tests in processes forked from a warm server.

A fresh ``python -m diffpipe_core.cli train`` of a tiny model spends about 12 of its 15 seconds importing
torch, DeepSpeed, diffusers, peft and datasets; a test suite that runs a hundred of them spends most of its
time there. Each test process therefore starts one server (:func:`serve`) that imports those libraries once,
the way the launcher does before it forks CPU workers (:func:`diffpipe_core.engine.forked_workers.preload`),
and forks a child for every command. The child is a new process in its own session: it takes the command's
working folder, environment and arguments, writes its stdout and stderr to files, and runs the real command
line, which starts (forks) its workers as it always does. Nothing of the run is in the server: it never loads
the plugin registry, a config or a model.

Each environment (but for what is read at run time) gets its own server (:func:`server_for`). PYTHONPATH
folders put before the test process's own (a test's throwaway plugins) are put on the child's ``sys.path`` where
a fresh process has them, unless they hold a module the server imported.
:func:`diffpipe_core.testing.processes.run_diffpipe` runs a fresh process where a fork could differ from one:
another program, ``--verbose``, or ``DIFFPIPE_TEST_FRESH_PROCESSES=1`` for the whole test run.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from diffpipe_core.engine.forked_workers import ForkedWorker

FRESH_ENV = "DIFFPIPE_TEST_FRESH_PROCESSES"
_READY = "ready"
_IMPORTED = "imported.txt"  # the top-level modules the server imported, one a line
_DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_RUN_TIME_ENV = ("DIFFPIPE_", "OMP_NUM_THREADS", "PYTEST_", "WANDB_", *_DISTRIBUTED_ENV)
# diffpipe's own and the thread count are read at run time, PYTEST_CURRENT_TEST not at all, and wandb is imported by
# the W&B logger at run time, never by the server; a node's rank and its master, set by an external launcher, are
# read when the command starts or joins the process group (the server is started without them)
"""Environment variables that a warm server's child may take from the command: the others (``PYTHONPATH``,
``HF_HOME``, the libraries' verbosity and offline settings) are read when the libraries are imported, so each
setting of them gets its own server."""
_VERBATIM_ENV = ("DIFFPIPE_VERBOSE",)  # read by the libraries' silencing, which ran in the server


def serve(socket_path: str) -> None:
    """The server: import the training libraries, then fork one child per request on ``socket_path``, reporting
    each child's pid at once and its exit code when it ends (several may run at once: a test may start a run and
    run another command beside it)."""
    import selectors

    from diffpipe_core.engine.forked_workers import preload
    from diffpipe_core.engine.launcher import _die_with_parent

    _die_with_parent()
    preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(8)
    imported = sorted({name.split(".")[0] for name in sys.modules})
    (Path(socket_path).parent / _IMPORTED).write_text("\n".join(imported))
    print(_READY, flush=True)
    running: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ)
        while True:
            if selector.select(timeout=0.05):
                conn, _ = server.accept()
                request = json.loads(conn.makefile("r").readline())
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    server.close()
                    for other in (conn, *running.values()):
                        other.close()
                    _run_child(request)
                conn.sendall(f"{pid}\n".encode())
                running[pid] = conn
            for pid in list(running):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    conn = running.pop(pid)
                    try:
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass  # the test gave up on it (timeout) and closed the connection
                    conn.close()


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the command (own session, files as stdout/stderr, its folder, environment and
    arguments), run the command line and leave with its exit code."""
    from diffpipe_core.engine.fast_exit import exit_now
    from diffpipe_core.engine.launcher import _die_with_parent

    code: int = 1
    try:
        os.setsid()
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        streams = ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], written), (2, request["stderr"], written))
        for fd, path, flags in streams:
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import importlib

        import torch

        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.path[1:1] = request.get("extra_paths", [])  # where a fresh process puts PYTHONPATH's folders
        importlib.invalidate_caches()
        sys.argv = ["diffpipe", *request["args"]]
        import runpy

        runpy.run_module("diffpipe_core.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    exit_now(code, run_atexit=False)


class _Server:
    """This test process's server: started on first use, stopped when the process exits."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.folder = Path(tempfile.mkdtemp(prefix="diffpipe-warm-"))
        self.socket_path = str(self.folder / "server.sock")
        code = f"from diffpipe_core.testing.warm_cli import serve; serve({self.socket_path!r})"
        with open(self.folder / "server.log", "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=self.env, stdout=subprocess.PIPE,
                                         stderr=log, text=True, start_new_session=True)
        atexit.register(self.stop)
        line = _read_line_within(self.proc, timeout=180)
        if line != _READY:
            self.stop()
            raise RuntimeError(f"the warm diffpipe server did not start: {(self.folder / 'server.log').read_text()}")
        self.runs = 0
        self.imported = set((self.folder / _IMPORTED).read_text().split())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, args: list[str], cwd: Path, env: dict[str, str]) -> WarmProcess:
        """Start the command in a forked child and return at once."""
        self.runs += 1
        out, err = self.folder / f"run{self.runs}.out", self.folder / f"run{self.runs}.err"
        request = {"args": args, "cwd": str(Path(cwd).resolve()), "env": env, "stdout": str(out), "stderr": str(err),
                   "extra_paths": _extra_paths(env) or []}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket_path)
        conn.sendall((json.dumps(request) + "\n").encode())
        return WarmProcess(conn, args, out, err)

    def run(self, args: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> tuple[int, str, str]:
        """Run the command in a forked child; ``(exit code, stdout, stderr)``. On timeout its whole process group is
        killed and TimeoutError raised."""
        proc = self.start(args, cwd, env)
        try:
            out, err = proc.communicate(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            raise TimeoutError(f"diffpipe {' '.join(args)} ran past {timeout}s\n{proc.tails()}") from None
        finally:
            _kill_group(proc.pid)  # stray workers, if any
        return proc.returncode, out, err


class WarmProcess:
    """A command running in a warm server's child, with the part of :class:`subprocess.Popen` tests use (``pid``,
    ``poll``, ``send_signal``, ``communicate``, ``returncode``). Its pid is also its process group's."""

    def __init__(self, conn: socket.socket, args: list[str], out: Path, err: Path) -> None:
        self.args, self._conn, self._out, self._err = args, conn, out, err
        self._received = b""
        pid = self._line(60)
        if pid is None:
            raise RuntimeError(f"the warm diffpipe server did not start diffpipe {' '.join(args)}")
        self.pid = int(pid)
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line, or None after ``timeout`` seconds (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)  # looked at once even at timeout 0 (poll)
            if ready:
                chunk = self._conn.recv(64)
                if not chunk:
                    raise RuntimeError(f"the warm diffpipe server died while running diffpipe {' '.join(self.args)}")
                self._received += chunk
            elif left == 0:
                return None
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                return None
            self.returncode = int(line)
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._wait(0)

    send_signal = ForkedWorker.send_signal  # a signal to the pid unless it ended

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the command to end (:class:`subprocess.TimeoutExpired` after ``timeout`` seconds, as
        ``Popen.communicate`` raises); its stdout and stderr."""
        if self._wait(timeout) is None:
            raise subprocess.TimeoutExpired(["diffpipe", *self.args], timeout or 0)
        texts = self._out.read_text(errors="replace"), self._err.read_text(errors="replace")
        self._out.unlink(missing_ok=True)
        self._err.unlink(missing_ok=True)
        return texts

    def tails(self) -> str:
        """The ends of what it printed so far."""
        return f"{_tail(self._out)}\n{_tail(self._err)}"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def _read_line_within(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            return ""
    return proc.stdout.readline().strip()



def _import_time_env(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    """The part of ``env`` that a process reads before (or while) importing the libraries (PYTHONPATH's folders
    before this process's own: see :func:`_extra_paths`)."""
    return frozenset(
        (k, v) for k, v in env.items() if (not k.startswith(_RUN_TIME_ENV) or k in _VERBATIM_ENV) and k != "PYTHONPATH"
    )


def _extra_paths(env: dict[str, str]) -> list[str] | None:
    """The folders ``env``'s PYTHONPATH puts before this process's own PYTHONPATH (a test's throwaway plugins),
    or None when it is not that."""
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if len(theirs) < len(own) or theirs[len(theirs) - len(own):] != own:
        return None
    return theirs[: len(theirs) - len(own)]


def _provided_modules(folder: str) -> set[str]:
    """The top-level modules a PYTHONPATH folder provides (metadata folders aside)."""
    path = Path(folder)
    if not path.is_dir():
        return set()
    return {p.name.split(".")[0] for p in path.iterdir() if not p.name.endswith((".dist-info", ".egg-info"))}


_servers: dict[frozenset[tuple[str, str]], _Server] = {}
_MAX_SERVERS = 3  # each holds the libraries (about 700 MB); a test process rarely needs more than two settings


def server_for(args: list[str], env: dict[str, str]) -> _Server | None:
    """A warm server whose fork runs ``diffpipe *args`` in ``env`` as a fresh process would (started now if this
    process has none for that environment yet); None where only a fresh process can: ``--verbose`` (the server
    silenced the libraries as they were imported), a PYTHONPATH other than folders before this process's own or
    one whose folders shadow a module the server imported, or ``DIFFPIPE_TEST_FRESH_PROCESSES`` set. Servers are
    kept for the environments used most recently."""
    extra = _extra_paths(env)
    if os.environ.get(FRESH_ENV) or "--verbose" in args or extra is None:
        return None
    key = _import_time_env(env)
    warm = _servers.pop(key, None)
    if warm is None or not warm.alive():
        if len(_servers) >= _MAX_SERVERS:
            _servers.pop(next(iter(_servers))).stop()  # the least recently used
        own = {k: v for k, v in env.items() if not k.startswith(("PYTEST_", *_DISTRIBUTED_ENV)) and k != "PYTHONPATH"}
        if os.environ.get("PYTHONPATH"):
            own["PYTHONPATH"] = os.environ["PYTHONPATH"]
        warm = _Server(own)
    _servers[key] = warm
    if any(_provided_modules(folder) & warm.imported for folder in extra):
        return None
    return warm
