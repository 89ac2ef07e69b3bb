"""Golden manifests of saved files: a refactor must leave what a run writes byte-for-byte the same.

A manifest (small JSON, committed beside a plugin's tests) records, for each safetensors file of a saved
adapter or model folder, its metadata and every tensor's dtype, shape and SHA-256 of its raw bytes. The
tests compare a fresh run's folder with it; a difference names the file and the tensors.

    python -m diffpipe_core.testing.golden SAVED_DIR MANIFEST.json   # write a manifest from a run's saved/final
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def file_manifest(path: Path) -> dict[str, Any]:
    """``{"metadata": {...}, "tensors": {key: "dtype shape sha256"}}`` of one safetensors file."""
    import torch
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        for key in sorted(f.keys()):
            t = f.get_tensor(key).contiguous()
            raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            shape = "x".join(str(n) for n in t.shape) or "scalar"
            tensors[key] = f"{str(t.dtype).removeprefix('torch.')} {shape} {hashlib.sha256(raw).hexdigest()}"
    return {"metadata": metadata, "tensors": tensors}


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
            if w["tensors"].get(key) != g["tensors"].get(key):
                found.append(f"{name}: {key}: {g['tensors'].get(key)} != {w['tensors'].get(key)}")
    return found


def assert_matches(folder: Path, manifest_file: Path) -> None:
    """Raise AssertionError listing (up to 10 of) the differences between ``folder`` and the manifest."""
    found = differences(folder, manifest_file)
    assert not found, f"{folder} differs from {manifest_file} in {len(found)} places:\n" + "\n".join(found[:10])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write the golden manifest of a saved folder.")
    parser.add_argument("folder", type=Path)
    parser.add_argument("manifest", type=Path)
    args = parser.parse_args(argv)
    args.manifest.parent.mkdir(parents=True, exist_ok=True)
    args.manifest.write_text(json.dumps(folder_manifest(args.folder), indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.manifest}")


if __name__ == "__main__":
    main()
