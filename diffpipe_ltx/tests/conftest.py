"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny LTX-Video written to disk per session
(diffusers folder + original-layout single file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def ltx2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared LTX-2 run: 1 process from the diffusers folder on clips and images (first-frame conditioning
    p = 0.5), sampling after the last step (test_ltx2_train, test_ltx2_sampling). Returns its run folder."""
    from test_ltx2_train import make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("ltx2_run")
    return runs.train(root, make_project(root), procs=1, timeout=500)


# the tiny models, each written once per session
tiny_ltx = tiny_model_fixture(
    "tiny_ltx",
    "diffpipe_ltx.testing:write_tiny_ltx",
    "A tiny LTX-Video folder; its single file is ``diffpipe_ltx.testing.single_file_path(folder)``.",
)
tiny_ltx2 = tiny_model_fixture(
    "tiny_ltx2",
    "diffpipe_ltx.ltx2_testing:write_tiny_ltx2",
    "A tiny LTX-2 folder (``LTX2Pipeline``); its single file is ``diffpipe_ltx.ltx2_testing.single_file_path``.",
)
tiny_ltx23 = tiny_model_fixture(
    "tiny_ltx23",
    "diffpipe_ltx.ltx2_testing:write_tiny_ltx23",
    "A tiny LTX-2.3 folder (``LTX2Pipeline``, LTX-2.3's switches on) and its single file beside it.",
)
tiny_ltx25 = tiny_model_fixture(
    "tiny_ltx25",
    "diffpipe_ltx.ltx2_testing:write_tiny_ltx25",
    "A tiny LTX-2.5 folder (``LTX25ModularPipeline``, ``modular_model_index.json``) and its single file beside it.",
)
