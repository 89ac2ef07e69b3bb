"""Issue 20.16 and 20.23: what the README, the scripts and the examples say is what they do."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DISTRIBUTIONS = sorted(p.parent.name for p in REPO.glob("diffpipe_*/pyproject.toml"))


def test_the_install_commands_name_what_the_repository_has() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", readme, flags=re.S))
    assert "pip install diffpipe-core" not in blocks  # not published yet: no such command is offered to run
    assert "not on PyPI yet" in readme and "scripts/wheels.sh" in readme
    wheels, setup = ((REPO / "scripts" / name).read_text() for name in ("wheels.sh", "setup.sh"))
    for dist in PLUGIN_DISTRIBUTIONS:  # every model plugin of the repository is built and installed
        assert f"./{dist}" in wheels and f"-e {dist}" in setup, dist


def test_the_demo_ends_with_the_loss_line() -> None:
    lines = [x for x in (REPO / "scripts" / "demo.sh").read_text().splitlines() if x.strip() and not x.startswith("#")]
    assert lines[-1].startswith('"$VENV/bin/diffpipe" train'), lines[-1]  # its summary line is the last


def test_the_demo_dataset_says_where_it_caches() -> None:
    toml = REPO / "examples" / "demo" / "dataset.toml"
    cache = (toml.parent / tomllib.loads(toml.read_text())["cache_dir"]).resolve().relative_to(REPO)
    assert f"cached under {cache.as_posix()}/" in toml.read_text().splitlines()[0]


def test_plugin_readmes_use_the_current_diffusers_dtype_argument() -> None:
    for readme in [*REPO.glob("diffpipe_*/README.md"), *REPO.glob("plugins/diffpipe_*/README.md")]:
        assert "torch_dtype=" not in readme.read_text(), readme  # deprecated in diffusers 0.42: dtype=


def test_the_suite_time_is_said_the_same_way_everywhere() -> None:
    said = re.search(r"about (\d+) minutes", (REPO / "scripts" / "test.sh").read_text())
    assert said, "scripts/test.sh says how long the suite takes"
    assert f"about {said.group(1)} minutes" in (REPO / "README.md").read_text()
