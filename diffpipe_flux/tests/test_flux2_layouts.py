"""Each FLUX.2 variant on the layout its shared run does not use (issue 24: 1- and 2-stage training for each model):
[klein] on 2 pipeline stages in 2 processes, [dev] in 1 process, a few steps from the shared run's cache. Same data,
noise, initial weights and a constant learning rate: the losses are the shared run's first ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_flux2_train import STEPS

from diffpipe_core.testing import runs

pytestmark = pytest.mark.slow

OTHER_STEPS = 4
#: entry point -> (its shared run's fixture, the stages that run does not use)
OTHER_LAYOUT = {"flux2-klein": ("klein_run", 2), "flux2": ("flux2_run", 1)}


@pytest.fixture(scope="module", params=list(OTHER_LAYOUT))
def other_layout(request: pytest.FixtureRequest) -> tuple[Path, Path, int]:
    """``(this run, the shared run, this run's stages)``."""
    fixture, stages = OTHER_LAYOUT[request.param]
    shared = request.getfixturevalue(fixture)
    root = shared.parent.parent
    text = (root / "run.toml").read_text()
    text = text[: text.index("[sample]")].replace(f"pipeline_stages = {3 - stages}", f"pipeline_stages = {stages}")
    text = text.replace(f"max_steps = {STEPS}", f"max_steps = {OTHER_STEPS}")
    text = text.replace(f"checkpoint_every_n_steps = {STEPS}", f"checkpoint_every_n_steps = {OTHER_STEPS}")
    (root / "other_layout.toml").write_text(text)
    return runs.train(root, "other_layout.toml", stages), shared, stages


def test_the_other_layout_trains_as_the_shared_run(other_layout: tuple[Path, Path, int]) -> None:
    run, shared, stages = other_layout
    runs.assert_trained_in_stages(run, OTHER_STEPS, stages)
    assert runs.losses(run) == pytest.approx(runs.losses(shared)[:OTHER_STEPS], rel=1e-4)
