"""Two "hosts" on one machine for multi-node tests: two Linux network namespaces joined by a veth pair, each with
its own address and its loopback up.

Making them needs iproute2's ``ip`` and CAP_NET_ADMIN (root); :func:`unavailable` says why they cannot be made
here, for a skip. :func:`two_hosts` always tears down what it made, ending every process still inside a
namespace first (a worker that a launcher started in its own session included)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the pair's /24 and its end of the veth pair."""

    namespace: str
    address: str
    interface: str

    def command(self, args: list[str]) -> list[str]:
        """``args`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (no ``ip``, no CAP_NET_ADMIN), tried by making and deleting
    one; None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    probe = f"diffpipe-probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` could not run: {exc}"
    if made.returncode:
        return f"cannot make a network namespace (needs root / CAP_NET_ADMIN): {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def end_processes(namespace: str) -> None:
    """SIGKILL every process inside ``namespace`` (all started by the test that made it)."""
    listed = _ip("netns", "pids", namespace, check=False)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def two_hosts(subnet: str = "10.77.0") -> Iterator[tuple[Host, Host]]:
    """Namespaces ``diffpipe-<pid>-a`` at ``<subnet>.1`` and ``-b`` at ``<subnet>.2``, joined by a veth pair; on
    exit every process left inside them is killed and both are deleted (with the pair)."""
    tag = os.getpid()
    hosts = tuple(Host(f"diffpipe-{tag}-{s}", f"{subnet}.{i}", f"dp{tag}{s}") for i, s in ((1, "a"), (2, "b")))
    made: list[Host] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            made.append(host)
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts[0], hosts[1]
    finally:
        for host in made:
            end_processes(host.namespace)
        for host in made:
            _ip("netns", "del", host.namespace, check=False)
        for host in hosts:  # an end not yet moved into its namespace (deleting a namespace deletes the ones in it)
            if _ip("link", "show", host.interface, check=False).returncode == 0:
                _ip("link", "del", host.interface, check=False)
