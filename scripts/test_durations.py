"""Write ``tests/durations.json`` (seconds per test module) from a pytest ``--durations=0`` report.

    python scripts/test_durations.py REPORT.txt

The suite's scheduler (``conftest.py``) starts the groups of modules that took longest first; refresh the file from
a run on an idle machine after adding or moving slow tests. Setup, call and teardown times all count, so a module's
figure includes the shared runs its fixtures train.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s\s+(?:setup|call|teardown)\s+(\S+?\.py)::")


def module_seconds(report: str) -> dict[str, float]:
    """Summed seconds of each test module named in ``report``'s durations lines, largest first."""
    seconds: dict[str, float] = {}
    for line in report.splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    seconds = module_seconds(Path(sys.argv[1]).read_text())
    if not seconds:
        sys.exit(f"{sys.argv[1]}: no durations lines (run pytest with --durations=0)")
    out = Path(__file__).resolve().parent.parent / "tests" / "durations.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(seconds, indent=1) + "\n")
    tmp.replace(out)
    print(f"{out}: {len(seconds)} modules, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main()
