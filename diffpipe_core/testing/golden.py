"""Golden manifests of saved files: a refactor must leave what a run writes byte-for-byte the same.

A manifest (small JSON, committed beside a plugin's tests) records, for each safetensors file of a saved
adapter or model folder, its metadata and, for every tensor, its dtype, shape and SHA-256 of its raw bytes (``id``),
its L2 norm and :data:`PROJECTIONS` fixed random projections of its values. The tests compare a fresh run's folder
with it; a difference names the file and the tensors.

Bytes are compared first: on a CPU like the one that wrote the manifest, a run is reproduced exactly. Another CPU
(another SIMD width, AMX) rounds matrix products differently, so a tensor whose bytes differ is still accepted when
its values are within :data:`RTOL` of the recorded ones (its difference's norm, estimated from the projections,
relative to the recorded norm). A changed key, layout, scale or training step moves values by far more.

    python -m diffpipe_core.testing.golden SAVED_DIR MANIFEST.json   # write a manifest from a run's saved/final
    DIFFPIPE_GOLDEN_WRITE=1 pytest ...                               # (re)write the manifests the tests compare

Writing never passes: with ``DIFFPIPE_GOLDEN_WRITE=1`` each golden test writes its manifest and then fails, so a
rewrite is never mistaken for a comparison (run the tests again without it to compare); ``scripts/test.sh`` refuses
to start while it is set.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

PROJECTIONS = 16
# AVX2 vs AVX512+AMX moved the bundled tiny runs' LoRA values by at most 2.8e-4 (SDXL; measured again: 1.2e-4 on
# AVX512 without AMX, 1.6e-4 with ATEN_CPU_CAPABILITY=avx2, every other model below 2.2e-5); 16 projections estimate
# a difference's norm to within a factor of 1.6 above its size (99.9%), so 1e-3 admits that drift, not a real change
RTOL = 1e-3
WRITE_ENV = "DIFFPIPE_GOLDEN_WRITE"


def file_manifest(path: Path) -> dict[str, Any]:
    """``{"metadata": {...}, "tensors": {key: {"id": "dtype shape sha256", "l2": norm, "proj": [...]}}}`` of one
    safetensors file."""
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        for key in sorted(f.keys()):
            tensors[key] = tensor_entry(key, f.get_tensor(key))
    return {"metadata": metadata, "tensors": tensors}


def tensor_entry(key: str, t: Any) -> dict[str, Any]:
    """One tensor's manifest entry: its exact ``id`` and the figures its values are compared by elsewhere."""
    import torch

    t = t.contiguous()
    raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    shape = "x".join(str(n) for n in t.shape) or "scalar"
    flat = t.detach().double().flatten()
    seed = int(hashlib.sha256(key.encode()).hexdigest()[:12], 16)
    rows = torch.randn(PROJECTIONS, flat.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    proj = (rows @ flat / max(flat.numel(), 1) ** 0.5).tolist() if t.is_floating_point() else []
    return {
        "id": f"{str(t.dtype).removeprefix('torch.')} {shape} {hashlib.sha256(raw).hexdigest()}",
        "l2": float(flat.norm()),
        "proj": " ".join(f"{v:.9g}" for v in proj),  # one string: the manifest stays a line per tensor figure
    }


def relative_difference(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The norm of the difference of two entries' tensors (estimated from their projections: each projection of a
    difference d has variance |d|^2 / n) over the wanted tensor's norm; inf when dtype or shape differ."""
    got_p, want_p = [float(v) for v in got["proj"].split()], [float(v) for v in want["proj"].split()]
    if got["id"].rsplit(" ", 1)[0] != want["id"].rsplit(" ", 1)[0] or len(got_p) != len(want_p) or not want_p:
        return float("inf")  # another dtype or shape, or an integer tensor (its bytes decide)
    n = 1
    for size in want["id"].split(" ")[1].split("x"):
        n *= int(size) if size != "scalar" else 1
    d = sum((a - b) ** 2 for a, b in zip(got_p, want_p)) ** 0.5 * (n / len(want_p)) ** 0.5
    return d / want["l2"] if want["l2"] > 0 else (0.0 if d == 0 else float("inf"))


def folder_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of every ``*.safetensors`` file in ``folder``, by file name."""
    return {p.name: file_manifest(p) for p in sorted(Path(folder).glob("*.safetensors"))}


def differences(folder: Path, manifest_file: Path) -> list[str]:
    """What differs between ``folder`` and the manifest: one line per file or tensor; ``[]`` when identical."""
    want = json.loads(Path(manifest_file).read_text())
    got = folder_manifest(folder)
    found: list[str] = []
    for name in sorted(set(want) | set(got)):
        if name not in got or name not in want:
            found.append(f"{name}: {'missing from ' + str(folder) if name not in got else 'not in the manifest'}")
            continue
        w, g = want[name], got[name]
        if w["metadata"] != g["metadata"]:
            found.append(f"{name}: metadata {g['metadata']} != {w['metadata']}")
        for key in sorted(set(w["tensors"]) | set(g["tensors"])):
            wt, gt = w["tensors"].get(key), g["tensors"].get(key)
            if wt is None or gt is None:
                found.append(f"{name}: {key}: {'missing' if gt is None else 'not in the manifest'}")
            elif wt["id"] != gt["id"] and (rel := relative_difference(gt, wt)) > RTOL:
                found.append(f"{name}: {key}: {gt['id']} != {wt['id']} (values {rel:.2g} apart, more than {RTOL})")
    return found


def assert_matches(folder: Path, manifest_file: Path) -> None:
    """Raise AssertionError listing (up to 10 of) the differences between ``folder`` and the manifest; with
    ``DIFFPIPE_GOLDEN_WRITE=1``, write the manifest of ``folder`` instead, then raise all the same (a rewrite
    never passes as a comparison)."""
    if os.environ.get(WRITE_ENV) == "1":
        write_manifest(folder, manifest_file)
        raise AssertionError(
            f"wrote {manifest_file} from {folder} ({WRITE_ENV}=1): nothing was compared; run again without "
            f"{WRITE_ENV} to compare"
        )
    found = differences(folder, manifest_file)
    assert not found, f"{folder} differs from {manifest_file} in {len(found)} places:\n" + "\n".join(found[:10])


def write_manifest(folder: Path, manifest_file: Path) -> None:
    from diffpipe_core.atomic import atomic_write_text

    manifest_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(manifest_file, json.dumps(folder_manifest(folder), indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write the golden manifest of a saved folder.")
    parser.add_argument("folder", type=Path)
    parser.add_argument("manifest", type=Path)
    args = parser.parse_args(argv)
    write_manifest(args.folder, args.manifest)
    print(f"wrote {args.manifest}")


if __name__ == "__main__":
    main()
