"""Issue 9.13: the demo (``scripts/demo.sh``: the tiny Flux, the bundled sample dataset,
``diffpipe_flux/examples/run.toml`` as shipped) shows learning: the mean loss of the last quarter of its steps
is well below the first quarter's, and the end-of-run line says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.engine.summary import quarter_means
from diffpipe_core.testing.processes import run_diffpipe

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_demo_config_loss_visibly_falls(tiny_flux: Path, tmp_path: Path) -> None:
    examples = REPO / "diffpipe_flux" / "examples"
    run = (examples / "run.toml").read_text()
    dataset = (examples / "dataset.toml").read_text()
    # the shipped configs, with their demo/ folders moved into tmp_path (the model is the demo's tiny Flux)
    run = run.replace("../../demo/flux-runs", str(tmp_path / "runs")).replace("../../demo/flux-tiny", str(tiny_flux))
    dataset = dataset.replace("../../demo/flux-cache", str(tmp_path / "cache"))
    dataset = dataset.replace("../../examples/sample_dataset", str(REPO / "examples" / "sample_dataset"))
    (tmp_path / "run.toml").write_text(run)
    (tmp_path / "dataset.toml").write_text(dataset)
    result = run_diffpipe(["train", "--config", "run.toml", "--num-procs", "1"], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.output[-4000:]
    (out,) = (tmp_path / "runs").iterdir()
    first, last = quarter_means(out)
    assert last < 0.8 * first, f"the demo's loss did not fall visibly: {first:.4f} -> {last:.4f}"
    assert f"mean loss {first:.4f} in the first quarter of steps -> {last:.4f} in the last" in result.stdout
