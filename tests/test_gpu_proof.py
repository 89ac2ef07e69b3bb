"""Issue 45: the GPU proof is ready before a GPU is. ``bench/gpu_proof.sh`` runs end to end on the CPU
(``DIFFPIPE_PROOF_DEVICE=cpu``) and writes the JSON keys the GPU run will write; the wheels it carries cover every
package it imports and fit, with the tree, in what a run may carry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from diffpipe_core.testing.processes import kill_group

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import proof_report  # noqa: E402
import proof_wheels  # noqa: E402

TOP_KEYS = {"ok", "device", "gpus", "torch", "cuda", "python", "date", "seconds", "install", "packages",
            "imports_not_carried", "tests", "memory"}  # fmt: skip
VARIANTS = {"plain", "checkpointing", "swap + offload", "nf4", "float8"}
VARIANT_KEYS = {"peak_gb", "step_s", "tflops", "mfu", "base_weight_gb", "swapped_blocks", "losses"}
TARGETS = {
    "plain MFU >= 40%", "swap + offload peak <= 8 GB", "swap + offload step <= 1.3x plain",
    "nf4 peak below plain's by >= the base bytes saved", "nf4 loss finite and falling",
    "float8 peak below plain's by >= the base bytes saved", "float8 loss finite and falling",
}  # fmt: skip


@pytest.mark.slow
def test_cpu_dry_run_writes_the_keys_the_gpu_run_writes(tmp_path: Path) -> None:
    env = {**os.environ, "DIFFPIPE_PROOF_DEVICE": "cpu", "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env["DIFFPIPE_PROOF_PYTHON"] = sys.executable
    proc = subprocess.Popen(["bash", str(REPO / "bench/gpu_proof.sh")], env=env, cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, output[-4000:]
    assert {p.name for p in tmp_path.iterdir()} == {"gpu_proof.log", "gpu_proof.json"}
    log = (tmp_path / "gpu_proof.log").read_text()
    assert "diffpipe: [4/4]" in log and "GPU proof on cpu" in log
    report = json.loads((tmp_path / "gpu_proof.json").read_text())
    assert set(report) == TOP_KEYS
    assert report["device"] == "cpu" and report["imports_not_carried"] == [], report["imports_not_carried"]
    tests = report["tests"]
    assert tests["failed"] == tests["error"] == 0 and tests["passed"] >= 10, tests
    nodes = tests["outcomes"]
    assert all(node.startswith("tests/test_cuda_proof.py::") and "[cpu" in node for node in nodes), "CPU twins only"
    memory = report["memory"]
    assert memory["rc"] == 0 and set(memory["variants"]) == VARIANTS and set(memory["targets"]) == TARGETS
    for name, variant in memory["variants"].items():
        assert set(variant) == VARIANT_KEYS, name
        assert variant["peak_gb"] is None and variant["mfu"] is None, "a CPU measures no GPU memory or MFU"
    assert memory["variants"]["swap + offload"]["swapped_blocks"] == 3
    assert report["ok"] is True
    assert set(report["packages"]) == {name for name, _ in proof_wheels.requirements()}


def test_an_import_neither_carried_nor_in_the_image_is_named(tmp_path: Path) -> None:
    (tmp_path / "1.txt").write_text("os\ntorch\ntransformers\npeft\ndeepspeed\ndiffpipe_core\ndill\ndatasets\npyarrow")
    (tmp_path / "2.txt").write_text("bitsandbytes\nnumpy\nxdist")
    assert proof_report.imports_not_carried(tmp_path) == ["datasets (datasets)", "pyarrow (pyarrow)",
                                                          "xdist (pytest-xdist)"]  # fmt: skip


def test_the_carried_versions_are_the_ones_ci_tests() -> None:
    from importlib import metadata

    differ = {n: (v, metadata.version(n)) for n, v in proof_wheels.requirements() if metadata.version(n) != v}
    assert not differ, f"bench/proof_wheels.txt pins other versions than this environment has: {differ}"


def test_the_wheel_list_parses_and_bad_lines_are_named(tmp_path: Path) -> None:
    wanted = dict(proof_wheels.requirements())
    assert {"deepspeed", "peft", "diffusers", "bitsandbytes", "pytest"} <= set(wanted)
    assert "datasets" not in wanted and "pyarrow" not in wanted
    bad = tmp_path / "list.txt"
    bad.write_text("# a comment\npeft==0.21.2\ndiffusers\n")
    with pytest.raises(SystemExit, match=r"list.txt:3: 'diffusers' is not name==version"):
        proof_wheels.requirements(bad)


def write_wheel(path: Path, files: dict[str, bytes]) -> Path:
    dist = "demo_pkg-1.0.dist-info"
    meta = {
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    every = {**files, **meta}
    record = "".join(f"{name},,\n" for name in every) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in every.items():
            z.writestr(name, data)
        z.writestr(f"{dist}/RECORD", record)
    return path


def test_repacked_wheel_leaves_out_the_dropped_libraries_and_installs(tmp_path: Path) -> None:
    files = {
        f"bitsandbytes/libbitsandbytes_{v}.so": os.urandom(4096)
        for v in (
            "cuda118",
            "cuda121",
            "cuda124",
            "cuda126",
            "cuda128",
            "cuda130",
            "cuda132",
            "rocm64",
            "xpu2025",
            "cpu",
        )
    }
    files["demo_pkg/__init__.py"] = b"VALUE = 1\n"
    wheel = write_wheel(tmp_path / "demo_pkg-1.0-py3-none-any.whl", files)  # fmt: skip
    saved = proof_wheels.repack_without(wheel, proof_wheels.DROPPED["bitsandbytes"])
    assert saved > 5 * 4096
    with zipfile.ZipFile(wheel) as z:
        kept = {n.rsplit("_", 1)[-1] for n in z.namelist() if n.endswith(".so")}
        record = z.read("demo_pkg-1.0.dist-info/RECORD").decode()
    assert kept == {"cuda126.so", "cuda128.so", "cuda130.so", "cuda132.so", "cpu.so"}
    assert "cuda118" not in record and "rocm64" not in record and "cuda128" in record
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), str(wheel)]
    subprocess.run(pip, check=True, capture_output=True, timeout=120)
    assert (target / "demo_pkg/__init__.py").exists() and (target / "bitsandbytes/libbitsandbytes_cuda130.so").exists()
    assert not (target / "bitsandbytes/libbitsandbytes_cuda118.so").exists()
    assert proof_wheels.repack_without(wheel, proof_wheels.DROPPED["bitsandbytes"]) == 0


def test_wheels_and_tree_over_the_carry_limit_are_refused(tmp_path: Path) -> None:
    small, large = tmp_path / "small-1-py3-none-any.whl", tmp_path / "large-1-py3-none-any.whl"
    small.write_bytes(b"x" * 1000)
    large.write_bytes(b"x" * 5000)
    assert proof_wheels.over_limit([small, large], tree=4000, limit=10_000) is None
    message = proof_wheels.over_limit([small, large], tree=4001, limit=10_000)
    assert message is not None and message.index("large-1") < message.index("small-1"), message
    assert proof_wheels.tree_bytes() < 16 * 2**20, "the tree alone takes a quarter of what a run may carry"
