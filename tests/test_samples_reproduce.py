"""Issue 48: the manual's diffusers call reproduces a sample of ``diffpipe sample``. The Python block of
docs/samples.md runs as written (a tiny Flux folder for the model, no LoRA: ``diffpipe sample`` runs the base model
too) for the second prompt of a ``diffpipe sample`` folder, and gives its image: the generator seeded
``seed * 1_000_003 + prompt index`` as the page says, while ``manual_seed(seed)`` gives another image."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffpipe_core.testing.processes import run_diffpipe

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a red cat", "a blue house"]
SEED, STEPS, GUIDANCE = 7, 3, 3.5


def page_snippet() -> str:
    """The Python block of the samples page that reproduces a sample."""
    page = (REPO / "docs" / "samples.md").read_text()
    mark = r"<!-- docs-check: python runs in tests/test_samples_reproduce.py[^>]*-->\n```python\n(.*?)```"
    (block,) = re.findall(mark, page, re.S)
    return block


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from diffpipe_flux.testing import write_tiny_flux

    root = tmp_path_factory.mktemp("reproduce")
    model = write_tiny_flux(root / "flux-tiny")
    (root / "run.toml").write_text(
        f'[model]\ntype = "flux"\npath = "{model}"\ndtype = "float32"\nencoder_dtype = "float32"\nt5_max_length = 16\n'
        f"[optimizer]\ntype = \"adamw\"\nlr = 1e-4\n"
        f"[sample]\nprompts = {json.dumps(PROMPTS)}\nsteps = {STEPS}\nseed = {SEED}\nguidance = {GUIDANCE}\n"
        "resolution = 64\n"
    )
    result = run_diffpipe(["sample", "--config", "run.toml", "--out", "out", "--num-procs", "1"], cwd=root, timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    return model, root / "out"


def run_snippet(model: Path, index: int, seed_formula: bool = True) -> np.ndarray:
    code = page_snippet().replace("seed, i = 0, 1", f"seed, i = {SEED}, {index}")
    assert f"seed, i = {SEED}, {index}" in code, "the page's snippet no longer starts with `seed, i = 0, 1`"
    code = "\n".join(line for line in code.splitlines() if "load_lora_weights" not in line)  # the base model
    if not seed_formula:
        code = code.replace("manual_seed(seed * 1_000_003 + i)", "manual_seed(seed)")
    scope = {"MODEL": str(model), "PROMPT": PROMPTS[index], "STEPS": STEPS, "HEIGHT": 64, "WIDTH": 64,
             "GUIDANCE": GUIDANCE}  # fmt: skip
    exec(compile(code, "docs/samples.md", "exec"), scope)  # noqa: S102 - the manual's own example
    return np.asarray(scope["image"].convert("RGB")).astype(int)


def test_the_samples_page_call_reproduces_a_sample(sampled: tuple[Path, Path]) -> None:
    model, out = sampled
    files = sorted(p.name for p in out.iterdir())
    assert files == ["00-a-red-cat.png", "01-a-blue-house.png", "contact-sheet.png", "latents.safetensors",
                     "prompts.json"], files  # fmt: skip
    ours = np.asarray(Image.open(out / "01-a-blue-house.png").convert("RGB")).astype(int)
    torch.manual_seed(0)
    theirs = run_snippet(model, 1)
    assert np.abs(ours - theirs).max() <= 1  # the same sample, up to the PNG's rounding
    naive = run_snippet(model, 1, seed_formula=False)
    assert np.abs(ours - naive).max() > 8  # manual_seed(seed) alone is another sample


def test_sample_help_names_the_files_it_writes() -> None:
    from click.testing import CliRunner

    from diffpipe_core.cli import main

    text = CliRunner().invoke(main, ["sample", "--help"]).output
    for name in ("contact-sheet.png", "latents.safetensors", "prompts.json", "seed * 1_000_003"):
        assert name in text, name
