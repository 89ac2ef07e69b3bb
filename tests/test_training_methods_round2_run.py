"""Issue 42, round two, in real training runs (the CLI, DeepSpeed on gloo, the real cache) on the reference model:

* gradient release of a full fine-tune logs the losses of the plain run, on 1 stage and on 2 (where the first stage
  runs one backward over its outputs), and its resume repeats them; every run's dataset has a regularisation folder
  trained toward the base model (for a full fine-tune: its initial weights, swapped in from host memory) at
  ``loss_weight = 0.5``, so regularisation runs on 1 and 2 stages and resumes too;
* a LoRA trained on a regularisation folder toward the base alone has a loss of exactly 0 at every step: the base
  pass (the adapter disabled, forward only) sees the same noise, timesteps and captions as the training pass, and the
  adapter's initial output is zero;
* Differential Output Preservation adds only its class-prompt term (0 while the adapter is zero: the first step's
  loss is the plain run's), and a run resumed on 2 stages (the adapter disabled on each) repeats its losses.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_train import make_project, run_dirs, train

from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.testing.media import write_image_dataset

pytestmark = pytest.mark.slow

REG = '\n[[directory]]\npath = "{path}"\nregularization = true\nregularization_target = "base"\nloss_weight = 0.5\n'


def _full_finetune(root: Path, stages: int, release: bool, name: str) -> Path:
    config = make_project(root, stages=stages, max_steps=4, ckpt=2, name=name)
    if not (root / "reg").exists():
        write_image_dataset(root / "reg", 4, size=(64, 64), seed=11)
        with (root / "dataset.toml").open("a") as f:
            f.write(REG.format(path=root / "reg"))
    text = config.read_text().replace("gradient_accumulation_steps = 2", "gradient_accumulation_steps = 1")
    text = text.replace("[adapter]\nrank = 8\nalpha = 16\ndropout = 0.1\n", "")
    text = text.replace('output_dir = "out"', f'output_dir = "out-{name[:-5]}"\ngradient_clipping = 0')
    text = text.replace("lr = 3e-3\n", "lr = 1e-4\n" + ("gradient_release = true\n" if release else ""))
    config.write_text(text)
    return config


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("release")
    runs = {}
    for name, stages, release in (("plain", 1, False), ("release", 1, True), ("release2", 2, True)):
        config = _full_finetune(root, stages, release, f"{name}.toml")
        runs[name + "_log"] = train(root, config, "--num-procs", str(stages))
        runs[name] = sorted((root / f"out-{name}").iterdir())[0]
    runs["root"] = root
    return runs


def test_gradient_release_repeats_the_plain_runs_losses_on_one_and_two_stages(full_runs: dict) -> None:
    plain, one, two = (train_losses(full_runs[k]) for k in ("plain", "release", "release2"))
    assert sorted(plain) == [1, 2, 3, 4] and len(set(plain.values())) == 4
    for step in range(1, 5):
        assert one[step] == pytest.approx(plain[step], rel=1e-5), step
        assert two[step] == pytest.approx(plain[step], rel=1e-3), step


def test_gradient_release_resume_repeats_every_loss(full_runs: dict, tmp_path: Path) -> None:
    run = full_runs["release"]
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-0000004", ignore_errors=True)
    shutil.rmtree(resumed / "saved")
    (resumed / "checkpoints" / "latest").write_text("step-0000002")
    train(full_runs["root"], full_runs["root"] / "release.toml", "--num-procs", "1", "--resume", str(resumed))
    expected, got = train_losses(run), train_losses(resumed)
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-8), step


def test_a_lora_toward_the_base_alone_has_zero_loss(tmp_path: Path) -> None:
    config = make_project(tmp_path, stages=1, max_steps=2, ckpt=2)
    keys = 'regularization = true\nregularization_target = "base"\nloss_weight = 2.0\n'
    (tmp_path / "dataset.toml").write_text((tmp_path / "dataset.toml").read_text() + keys)
    out = train(tmp_path, config, "--num-procs", "1")
    losses = train_losses(run_dirs(tmp_path)[0])
    assert losses == {1: 0.0, 2: 0.0}, (losses, out[-2000:])
    assert "toward the base model's own prediction" in out  # what train says of the dataset


DOP = ('trigger_word = "caption"\ndiff_output_preservation = true\ndiff_output_preservation_class = "photo"\n'
       "diff_output_preservation_multiplier = 2.0\n")


@pytest.fixture(scope="module")
def dop_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A LoRA with Differential Output Preservation (captions 'caption i', class prompts 'photo i'), 1 stage."""
    root = tmp_path_factory.mktemp("dop")
    config = make_project(root, stages=1, max_steps=4, ckpt=2)
    (root / "dataset.toml").write_text(DOP + (root / "dataset.toml").read_text())
    train(root, config, "--num-procs", "1")
    return root, run_dirs(root)[0]


def test_dop_changes_the_loss_only_by_the_class_prompts_term(dop_run: tuple[Path, Path], tmp_path: Path) -> None:
    """At step 1 the adapter's output is zero, so the class prompts' predictions equal the base model's and the DOP
    term is 0: the loss is the plain run's. Later it is not (the adapter has moved)."""
    root, run = dop_run
    plain = make_project(tmp_path, stages=1, max_steps=2, ckpt=2)
    train(tmp_path, plain, "--num-procs", "1")
    with_dop, without = train_losses(run), train_losses(run_dirs(tmp_path)[0])
    assert with_dop[1] == pytest.approx(without[1], rel=1e-5)
    assert with_dop[2] != pytest.approx(without[2], rel=1e-5)


def test_dop_resumed_on_two_stages_repeats_every_loss(dop_run: tuple[Path, Path], tmp_path: Path) -> None:
    root, run = dop_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-0000004", ignore_errors=True)
    shutil.rmtree(resumed / "saved")
    (resumed / "checkpoints" / "latest").write_text("step-0000002")
    config = root / "run2.toml"
    config.write_text((root / "run.toml").read_text().replace("pipeline_stages = 1", "pipeline_stages = 2\n"
                                                               "partition_split = [2]"))
    train(root, config, "--num-procs", "2", "--resume", str(resumed))
    expected, got = train_losses(run), train_losses(resumed)
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
