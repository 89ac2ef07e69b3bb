"""The GPU proof's JSON (``bench/gpu_proof.sh``, step 4): what ran, what passed, what was measured.

The keys are the same on a GPU and on the CPU dry run (values that only a GPU measures are null on the CPU), so
tests/test_gpu_proof.py, which runs the dry run, checks the keys the GPU run will write. ``ok`` is true when the
carried wheels installed, every selected test passed, the memory bench measured all its variants and (on the dry
run) every imported package is carried or in the GPU machine's image; otherwise the JSON is written all the same
and the exit code is 1. Whether the memory targets are met is in ``memory.targets``: a measurement, not a failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # diffpipe_core's atomic write, run as a script

from proof_wheels import normalised, requirements  # noqa: E402

from diffpipe_core.atomic import atomic_write_text  # noqa: E402

IMAGE = ("torch", "transformers", "safetensors", "pluggy", "click")
"""What the GPU machine's image has (with what they require); everything else the proof imports is carried."""
SOURCE = ("diffpipe_core", "diffpipe_flux", "diffpipe_reference", "conftest", "sitecustomize")
"""Top-level modules that travel as the working tree's source."""
OPTIONAL = {
    "colorama": "torch's inductor colours its messages with it when installed (mkdocs-material installs it here)",
    "dill": "torch checks whether it is installed",
    "google": "a check for protobuf (importlib.util.find_spec('google.protobuf') imports the namespace package)",
}
"""Modules the dry run imports only to see whether they are installed: the GPU run goes on without them."""
KEYS = ("ok", "device", "gpus", "torch", "cuda", "python", "date", "seconds", "install", "packages",
        "imports_not_carried", "tests", "memory")  # fmt: skip
VARIANTS = ("plain", "checkpointing", "swap + offload", "nf4", "float8")
OUTCOME = re.compile(r"^(?:(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)|(PASSED|FAILED|ERROR) (\S+::\S+))")


def outcomes(text: str) -> dict[str, str]:
    """Each test's outcome from pytest's ``-v`` (and ``-rA``) output: as far as it got, should it be killed."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = OUTCOME.match(line.strip())
        if m:
            node, outcome = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            out[node] = outcome.lower()
    return out


def image_distributions() -> set[str]:
    """The normalised names of :data:`IMAGE` and of everything they require (by this environment's metadata)."""
    seen: set[str] = set()
    todo = list(IMAGE)
    while todo:
        name = todo.pop()
        if normalised(name) in seen:
            continue
        seen.add(normalised(name))
        try:
            required = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in required:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def imports_not_carried(folder: Path) -> list[str]:
    """Top-level modules some process of the dry run imported (files in ``folder``) whose distribution is neither
    carried (``proof_wheels.txt``) nor in the image: the GPU machine would fail to import them."""
    imported = {line for f in folder.glob("*.txt") for line in f.read_text().split()}
    owners = metadata.packages_distributions()
    allowed = image_distributions() | {normalised(name) for name, _ in requirements()}
    missing = []
    for module in sorted(imported):
        if module in sys.stdlib_module_names or module.startswith("_") or module in SOURCE or module in OPTIONAL:
            continue
        dists = owners.get(module)
        if not dists:  # test modules, compiled-in helpers: not from a distribution
            continue
        if not any(normalised(d) in allowed for d in dists):
            missing.append(f"{module} ({', '.join(sorted(set(dists)))})")
    return missing


def installed_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, _ in requirements():
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def compose(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    tests_text = (args.work / "tests.txt").read_text() if (args.work / "tests.txt").exists() else ""
    found = outcomes(tests_text)
    counts = {k: sum(v == k for v in found.values()) for k in ("passed", "failed", "skipped", "error")}
    memory_file = args.work / "memory.json"
    memory = json.loads(memory_file.read_text()) if memory_file.exists() else {"variants": {}, "targets": {}}
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    imports = args.work / "imports"
    missing = imports_not_carried(imports) if imports.is_dir() else None
    report = {
        "device": args.device,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": args.seconds,
        "install": {"rc": args.install_rc, "wheels": len(list(Path(".whl").glob("*.whl")))},
        "packages": installed_versions(),
        "imports_not_carried": missing,
        "tests": {"rc": args.tests_rc, "seconds": args.tests_seconds, **counts, "outcomes": found},
        "memory": {"rc": args.memory_rc, "seconds": args.memory_seconds, **memory},
    }
    report["ok"] = (
        args.install_rc in (0, -1)  # -1: the dry run without .whl/, on this environment's packages
        and args.tests_rc == 0
        and counts["passed"] > 0
        and not counts["failed"] + counts["error"]
        and args.memory_rc == 0
        and set(memory["variants"]) == set(VARIANTS)
        and not missing
    )
    return {key: report[key] for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", required=True)
    parser.add_argument("--work", type=Path, required=True, help="gpu_proof.sh's work folder")
    parser.add_argument("--out", type=Path, required=True)
    for name in ("install-rc", "tests-rc", "tests-seconds", "memory-rc", "memory-seconds", "seconds"):
        parser.add_argument(f"--{name}", type=int, required=True)
    args = parser.parse_args()
    report = compose(args)
    atomic_write_text(args.out, json.dumps(report, indent=1))
    tests, memory = report["tests"], report["memory"]
    print(f"diffpipe: GPU proof on {args.device} ({', '.join(report['gpus']) or 'no GPU'}): "
          f"{'OK' if report['ok'] else 'NOT OK'}; tests {tests['passed']} passed, {tests['failed']} failed, "
          f"{tests['skipped']} skipped, {tests['error']} errors; memory bench {len(memory['variants'])} of "
          f"{len(VARIANTS)} variants; {args.seconds} s; {args.out}", flush=True)  # fmt: skip
    if report["imports_not_carried"]:
        print(f"diffpipe: imported but neither carried nor in the image: {', '.join(report['imports_not_carried'])}; "
              "add them to bench/proof_wheels.txt", flush=True)  # fmt: skip
    if not report["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
