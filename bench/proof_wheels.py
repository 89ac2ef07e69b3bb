"""Build the wheels ``bench/gpu_proof.sh`` carries to a GPU machine, into ``.whl/`` (ignored by git).

    python bench/proof_wheels.py [--dest .whl] [--limit-mib 64]

Reads ``bench/proof_wheels.txt`` (``name==version`` lines; it says what is left out and why) and, for a GPU machine
running CPython 3.12 on x86-64 Linux:

- downloads each wheel (``pip download --only-binary=:all:`` for cp312 manylinux x86-64, or a pure-Python one);
- builds DeepSpeed's, which has no wheel on the index, from its sdist (``pip wheel --no-build-isolation --no-deps``:
  its setup imports this environment's torch; no op is prebuilt);
- repacks bitsandbytes' wheel without the libraries for CUDA before 12.6, ROCm and XPU (torch 2.13's CUDA builds
  are 12.6 or newer), which take it from 43 MB to about a third of that.

Wheels already in ``--dest`` are kept. Ends by checking what a run carries: these wheels and the working tree (the
files git tracks or would add) must fit in ``--limit-mib`` (the device tool's 64 MiB); over it, it names the
largest wheels and exits 1.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIST = Path(__file__).with_name("proof_wheels.txt")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
BUILT_FROM_SOURCE = {"deepspeed"}
DROPPED = {"bitsandbytes": re.compile(r"bitsandbytes/libbitsandbytes_(cuda11\d|cuda12[0-5]|rocm\d+|xpu\d+)\.so$")}


def requirements(path: Path = LIST) -> list[tuple[str, str]]:
    """``(name, version)`` of each ``name==version`` line of the list (comments and blank lines skipped)."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise SystemExit(f"{path}:{number}: {line!r} is not name==version")
        out.append((name.strip(), version.strip()))
    return out


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_for(dest: Path, name: str, version: str) -> Path | None:
    """The wheel of ``name`` ``version`` already in ``dest``, if any."""
    prefix = f"{normalised(name)}-{version}-"
    return next((w for w in sorted(dest.glob("*.whl")) if w.name.lower().startswith(prefix.lower())), None)


def pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "--quiet", *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"diffpipe: pip {' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def fetch(dest: Path, name: str, version: str) -> Path:
    spec = f"{name}=={version}"
    if name in BUILT_FROM_SOURCE:
        pip("wheel", "--no-build-isolation", "--no-deps", "--wheel-dir", str(dest), spec)
    else:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *platforms, "--dest", str(dest), spec)  # fmt: skip
    wheel = wheel_for(dest, name, version)
    if wheel is None:
        raise SystemExit(f"diffpipe: pip gave no wheel named {normalised(name)}-{version}-*.whl in {dest}")
    return wheel


def repack_without(wheel: Path, dropped: re.Pattern[str]) -> int:
    """Rewrite ``wheel`` without the members matching ``dropped`` (and their RECORD lines); the bytes saved."""
    before = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as src:
        names = [n for n in src.namelist() if not dropped.search(n)]
        if len(names) == len(src.namelist()):
            return 0
        with tempfile.NamedTemporaryFile(dir=wheel.parent, suffix=".part", delete=False) as tmp:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
                for name in names:
                    data = src.read(name)
                    if name.endswith(".dist-info/RECORD"):
                        lines = [line for line in data.decode().splitlines() if not dropped.search(line.split(",")[0])]
                        data = ("\n".join(lines) + "\n").encode()
                    out.writestr(src.getinfo(name), data)
    Path(tmp.name).replace(wheel)
    return before - wheel.stat().st_size


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of the working tree a run carries: the files git tracks or would add (not the ignored ones)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    return sum((repo / f).stat().st_size for f in listed if f and (repo / f).is_file())


def over_limit(wheels: list[Path], tree: int, limit: int) -> str | None:
    """None when the wheels and the tree fit in ``limit`` bytes, else a one-line message naming the largest."""
    total = tree + sum(w.stat().st_size for w in wheels)
    if total <= limit:
        return None
    largest = sorted(wheels, key=lambda w: -w.stat().st_size)[:3]
    names = ", ".join(f"{w.name} ({w.stat().st_size / 2**20:.1f} MiB)" for w in largest)
    return (f"the wheels and the tree take {total / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB a run may carry; "
            f"largest: {names}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO / ".whl")
    parser.add_argument("--limit-mib", type=float, default=64.0)
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    wanted = requirements()
    wheels = []
    for i, (name, version) in enumerate(wanted, 1):
        wheel = wheel_for(args.dest, name, version)
        how = "kept"
        if wheel is None:
            wheel, how = fetch(args.dest, name, version), "built" if name in BUILT_FROM_SOURCE else "downloaded"
        if name in DROPPED:
            saved = repack_without(wheel, DROPPED[name])
            how += f", {saved / 2**20:.1f} MiB of libraries left out" if saved else ""
        wheels.append(wheel)
        print(f"diffpipe: [{i}/{len(wanted)}] {wheel.name} {wheel.stat().st_size / 2**20:.2f} MiB ({how})", flush=True)
    stray = sorted(set(args.dest.glob("*.whl")) - set(wheels))
    if stray:
        raise SystemExit(f"diffpipe: {args.dest} holds wheels not in {LIST.name}: {', '.join(w.name for w in stray)}; "
                         "delete them (gpu_proof.sh installs every wheel there)")  # fmt: skip
    tree = tree_bytes()
    problem = over_limit(wheels, tree, int(args.limit_mib * 2**20))
    if problem:
        raise SystemExit(f"diffpipe: {problem}")
    total = sum(w.stat().st_size for w in wheels)
    print(f"diffpipe: {len(wheels)} wheels, {total / 2**20:.1f} MiB, and the tree, {tree / 2**20:.1f} MiB: "
          f"{(total + tree) / 2**20:.1f} of {args.limit_mib:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
