"""The manual's reliability table (issue 37; docs/resume.md since issue 48): at least 40 fault classes, each naming
a test that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_fault_class_names_a_test_that_exists() -> None:
    page = (ROOT / "docs" / "resume.md").read_text()
    section = page.split("## Reliability: the faults tested", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| fault ")]
    assert len(rows) >= 40, len(rows)
    for row in rows:
        cell = row.rstrip(" |").rsplit("| ", 1)[1].strip("`")
        file = None
        for ref in re.findall(r"([\w/.]+\.py)?::(test_\w+)", cell):
            file = ROOT / ref[0] if ref[0] else file
            assert file is not None and file.is_file(), row
            assert re.search(rf"^(async )?def {ref[1]}\(", file.read_text(), re.M), (ref[1], file)
