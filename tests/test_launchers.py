"""Launching beyond our own launcher (issue 10): as workers of an external launcher, and DeepSpeed's hostfile
launcher. Both train 2 pipeline stages on loopback and must save one adapter; and (issue 44) two "hosts" made of
network namespaces train 2 stages across them with torchrun's multi-node rendezvous."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import make_project, run_dirs, train

from diffpipe_core.engine.forked_workers import START_ENV, start_method
from diffpipe_core.engine.gloo_interface import choose_gloo_interface, ipv4_address
from diffpipe_core.engine.launcher import free_port, hostfile_slots
from diffpipe_core.engine.run_dir import read_metrics
from diffpipe_core.testing import netns
from diffpipe_core.testing.processes import cli_env, kill_group, start_diffpipe
from diffpipe_core.testing.warm_cli import WarmProcess

pytestmark = pytest.mark.slow


def run_nodes(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path, timeout: float = 400) -> list[str]:
    """Start one command per node (each in its own session, its output to ``node<i>.log``), wait for all of them
    (at most ``timeout`` seconds), kill what is left, and assert every node exited 0; returns the nodes' logs.
    A command that is ``diffpipe`` arguments (``["train", ...]``) is forked from the tests' warm server, as a fresh
    ``diffpipe`` would run (``start_diffpipe``); any other is started as it is."""
    procs: list[subprocess.Popen | WarmProcess] = []
    logs = [cwd / f"node{i}.log" for i in range(len(commands))]
    try:
        for command, env, log in zip(commands, envs, logs, strict=True):
            if command[0] == "train":
                procs.append(start_diffpipe(command, cwd, env))
                continue
            with log.open("w") as out:
                procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            kill_group(p)
        for p, log in zip(procs, logs, strict=False):
            if isinstance(p, WarmProcess):
                if p.poll() is not None:  # a forked command: what it printed
                    log.write_text("".join(p.communicate(0)))
            elif (printed := p.communicate()) != (None, None):  # a fresh diffpipe (DIFFPIPE_TEST_FRESH_PROCESSES)
                log.write_text("".join(printed))
    texts = [log.read_text() if log.exists() else "" for log in logs]
    assert codes == [0] * len(commands), "\n".join(f"--- node {i}\n{t[-3000:]}" for i, t in enumerate(texts))
    return texts


TRAIN = [sys.executable, "-m", "diffpipe_core.cli", "train", "--config"]


def test_two_nodes_started_by_a_scheduler_train_two_stages(tmp_path: Path) -> None:
    """What a SLURM script does: one `diffpipe train` per node, with node ranks 0 and 1 and one worker each (each
    forked from the warm server with its node's environment, as a fresh `diffpipe train` runs)."""
    config = make_project(tmp_path, stages=2, max_steps=4, ckpt=100)
    port = str(free_port())
    envs = [cli_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            for r in (0, 1)]  # fmt: skip
    logs = run_nodes([["train", "--config", str(config)]] * 2, envs, tmp_path)
    runs = run_dirs(tmp_path)
    assert len(runs) == 1, f"the nodes made {len(runs)} run folders\n{logs}"
    assert [r["step"] for r in read_metrics(runs[0]) if "loss" in r] == [1, 2, 3, 4]
    assert (runs[0] / "saved" / "final" / "adapter_model.safetensors").is_file()
    assert "diffpipe: run folder" in logs[0]


def test_two_hosts_in_network_namespaces_train_two_stages(reference_two_stages: Path, tmp_path: Path) -> None:
    """Issue 44, beyond one host: two "hosts" (network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2)
    each run torchrun's node of a 2-node job (c10d rendezvous at host A's address, one worker each) over
    `diffpipe train`: the two stages train the one-host 2-stage run's losses, one stage on each host."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    config = make_project(tmp_path, stages=2, max_steps=3, ckpt=100)
    with netns.two_hosts() as hosts:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:29500",
                      "--rdzv-id", f"diffpipe-{os.getpid()}", "--max-restarts", "0"]  # fmt: skip
        commands = [
            host.command([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                          *rendezvous, "--rdzv-conf", f"is_host={int(host is hosts[0])}", "--local-addr", host.address,
                          "-m", *TRAIN[2:], str(config)])
            for host in hosts
        ]  # host A serves the rendezvous store (torchrun cannot tell that 10.77.0.1 is its own address)  # fmt: skip
        reports = [tmp_path / f"memory-{host.namespace}" for host in hosts]  # each host's workers' own files
        logs = run_nodes(commands, [cli_env(DIFFPIPE_MEMORY_REPORT=str(r)) for r in reports], tmp_path, timeout=150)
    runs = run_dirs(tmp_path)
    assert len(runs) == 1, f"the nodes made {len(runs)} run folders\n{logs}"
    on_two_hosts = [r["loss"] for r in read_metrics(runs[0]) if "loss" in r]
    one_host = [r["loss"] for r in read_metrics(reference_two_stages) if "loss" in r][:3]
    assert on_two_hosts == pytest.approx(one_host, rel=1e-6, abs=1e-7) and len(on_two_hosts) == 3
    stages = [[json.loads(f.read_text())["stage"] for f in sorted(folder.glob("rank*.json"))] for folder in reports]
    assert sorted(stages) == [[0], [1]], f"stages run on each host: {stages}\n{logs}"
    assert (runs[0] / "saved" / "final" / "adapter_model.safetensors").is_file()


def test_a_hostfile_hands_the_launch_to_deepspeed(reference_two_stages: Path, tmp_path: Path) -> None:
    """DeepSpeed's launcher starts each worker as a fresh ``python -m diffpipe_core.engine.worker``, as GPU workers
    start (our launcher forks CPU workers from a process that imported the libraries once): the fresh workers train
    the forked reference run's first steps, step for step (at its constant learning rate)."""
    config = make_project(tmp_path, stages=2, max_steps=3, ckpt=100)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one machine, two workers\nlocalhost slots=2\n")
    assert hostfile_slots(hostfile) == 2
    train(tmp_path, config, "--hostfile", str(hostfile), timeout=400)  # no --num-procs: the hostfile's 2 slots
    run = run_dirs(tmp_path)[0]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3]
    assert (run / "saved" / "final" / "adapter_model.safetensors").is_file()
    fresh = [r["loss"] for r in read_metrics(run) if "loss" in r]
    forked = [r["loss"] for r in read_metrics(reference_two_stages) if "loss" in r][:3]
    assert fresh == pytest.approx(forked, rel=1e-6, abs=1e-7)


def test_a_malformed_hostfile_is_named(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 gpus=4\n")
    with pytest.raises(ValueError, match=r"hosts:2: expected 'hostname slots=N', got 'node2 gpus=4'"):
        hostfile_slots(hostfile)


def test_worker_start_env_chooses_fresh_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DIFFPIPE_WORKER_START=spawn`` makes our launcher start CPU workers fresh (``subprocess.Popen`` of the worker
    module, as for NCCL); a fresh worker trains what a forked one trains (the hostfile test above: DeepSpeed starts
    the same module fresh), and the launcher's Popen start is what tests/test_stopping.py's workers run under."""
    monkeypatch.delenv(START_ENV, raising=False)
    assert (start_method("gloo"), start_method("nccl")) == ("fork", "spawn")
    monkeypatch.setenv(START_ENV, "spawn")
    assert (start_method("gloo"), start_method("nccl")) == ("spawn", "spawn")
    monkeypatch.setenv(START_ENV, "thread")
    with pytest.raises(ValueError, match=r"DIFFPIPE_WORKER_START='thread': expected one of fork, spawn"):
        start_method("gloo")


def test_gloo_is_told_the_interface_of_the_route_to_the_master() -> None:
    """A worker names, for gloo, the interface its machine reaches MASTER_ADDR through (a master address of this
    machine: that address's own interface), and leaves loopback runs and a GLOO_SOCKET_IFNAME already set alone."""
    own = [(name, address) for _, name in socket.if_nameindex()
           if (address := ipv4_address(name)) and not address.startswith("127.")]  # fmt: skip
    if own:
        name, address = own[0]
        env = {"MASTER_ADDR": address}
        assert choose_gloo_interface(env) == name and env["GLOO_SOCKET_IFNAME"] == name
    for env in ({"MASTER_ADDR": "127.0.0.1"}, {"MASTER_ADDR": "localhost"}, {}):
        assert choose_gloo_interface(env) is None and "GLOO_SOCKET_IFNAME" not in env
    chosen = {"MASTER_ADDR": own[0][1] if own else "10.0.0.1", "GLOO_SOCKET_IFNAME": "ib0"}
    assert choose_gloo_interface(chosen) is None and chosen["GLOO_SOCKET_IFNAME"] == "ib0"
