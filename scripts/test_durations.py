"""Write ``tests/durations.json`` (seconds per test module) from a pytest ``--durations=0`` report.

    python scripts/test_durations.py REPORT.txt                        # the whole suite's report: replaces the file
    python scripts/test_durations.py REPORT.txt --merge MODULE [...]   # some modules' report, merged in

The suite's scheduler (``conftest.py``) starts the groups of modules that took longest first; refresh the file from
a run on an idle machine after adding or moving slow tests. Setup, call and teardown times all count, so a module's
figure includes the shared runs its fixtures train.

``--merge`` (a few modules, or a busy machine) adds the report's modules to the committed ones, or replaces them,
scaled to an idle machine's seconds: the report must also hold the MODULEs, whose committed figures are kept
(calibration modules, run at the start and at the end of the same pytest process), and every other module's seconds
are scaled by the committed sum of those over their sum in the report. A report's module named by a path pytest
shortened (``tests/test_x.py`` for ``plugins/diffpipe_x/tests/test_x.py``, when the files given were not all under
the root's ``tests/``) is found by its file name, which is unique across the suite.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s\s+(?:setup|call|teardown)\s+(\S+?\.py)::")
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "durations.json"


def module_seconds(report: str) -> dict[str, float]:
    """Summed seconds of each test module named in ``report``'s durations lines, largest first."""
    seconds: dict[str, float] = {}
    for line in report.splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


def resolve(module: str, root: Path = ROOT) -> str:
    """``module`` as a path from the repository root: as it is when that file exists, else the one test file of
    that name under the root (pytest shortens node ids to the common folder of the files it was given)."""
    if (root / module).is_file():
        return module
    name = Path(module).name
    found = [p for p in root.rglob(name) if ".venv" not in p.parts and "fixtures" not in p.parts]
    if len(found) != 1:
        raise SystemExit(f"{module}: {len(found)} files named {name} under {root}: name the module by its path")
    return found[0].relative_to(root).as_posix()


def merged(committed: dict[str, float], measured: dict[str, float], keep: list[str]) -> dict[str, float]:
    """``committed`` with ``measured``'s modules added or replaced, scaled by the committed seconds of the ``keep``
    modules (measured in the same run, their committed figures kept) over their measured seconds."""
    missing = [m for m in keep if m not in committed or m not in measured]
    if not keep or missing:
        raise SystemExit(f"calibration modules must be both committed and in the report: {missing or 'none given'}")
    scale = sum(committed[m] for m in keep) / sum(measured[m] for m in keep)
    out = dict(committed)
    out.update({m: round(s * scale, 1) for m, s in measured.items() if m not in keep})
    print(f"scaled by {scale:.2f} (calibration: {', '.join(keep)})")
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("--merge", nargs="+", metavar="CALIBRATION_MODULE",
                        help="merge into the committed file, scaled by these modules' committed seconds")  # fmt: skip
    args = parser.parse_args()
    seconds = module_seconds(args.report.read_text())
    if not seconds:
        raise SystemExit(f"{args.report}: no durations lines (run pytest with --durations=0)")
    if args.merge:
        measured = {resolve(m): s for m, s in seconds.items()}
        seconds = merged(json.loads(OUT.read_text()), measured, [resolve(m) for m in args.merge])
    tmp = OUT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(seconds, indent=1) + "\n")
    tmp.replace(OUT)
    print(f"{OUT}: {len(seconds)} modules, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main()
