"""End-to-end training through the real CLI: DeepSpeed (gloo) workers, the real cache, peft LoRA.

Acceptance 2 (1 process, 2 pipeline stages, 2 data-parallel replicas; loss falls), 3 (SIGKILL and
resume repeats the uninterrupted losses) and 5 (a saved LoRA reproduces the trained outputs).
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffpipe_core.adapters import load_adapter, read_adapter
from diffpipe_core.engine.run_dir import read_metrics, step_seconds, train_losses
from diffpipe_core.engine.summary import quarter_means
from diffpipe_core.optim import lr_lambda
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import (
    cli_env,
    kill_group,
    paused_at,
    run_diffpipe,
    start_diffpipe,
    wait_for_file,
    write_plugin_distribution,
)
from diffpipe_reference.model import TinyDiT, read_config, write_tiny_model

pytestmark = pytest.mark.slow

RUN_TOML = """
output_dir = "out"
dataset = "dataset.toml"
max_steps = {max_steps}
micro_batch_size_per_gpu = 2
gradient_accumulation_steps = 2
pipeline_stages = {stages}
{split}checkpoint_every_n_steps = {ckpt}
warmup_steps = 2
lr_scheduler = "cosine"
seed = 7

[model]
type = "reference"
path = "model"
timestep_sample_method = "uniform"

[adapter]
rank = 8
alpha = 16
dropout = 0.1

[optimizer]
lr = 3e-3
"""


def make_project(
    root: Path,
    *,
    stages: int = 1,
    max_steps: int = 12,
    ckpt: int = 4,
    name: str = "run.toml",
    extra: str = "",
    tables: str = "",
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model").exists():
        write_tiny_model(root / "model")
        write_image_dataset(root / "images", 8, size=(64, 64))
        write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])
    # one split for every 2-stage run here: the memory plan would move the boundary with the memory savers, and
    # the runs compared must put the same layers (and so the same LoRA draws) on each stage
    split = "partition_split = [2]\n" if stages == 2 else ""
    text = RUN_TOML.format(max_steps=max_steps, stages=stages, ckpt=ckpt, split=split)
    (root / name).write_text(extra + text + tables)
    return root / name


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in (root / "out").iterdir() if p.is_dir())


losses = train_losses


def train(root: Path, config: Path, *args: str, timeout: float = 400, env=None) -> str:
    result = run_diffpipe(["train", "--config", str(config), *args], cwd=root, timeout=timeout, env=env)
    assert result.returncode == 0, result.output[-4000:]
    return result.output


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 1-process run, shared by several tests."""
    root = tmp_path_factory.mktemp("single")
    config = make_project(root, stages=1, max_steps=30, ckpt=10, extra="save_every_n_epochs = 5\n")
    write_image_dataset(root / "uncaptioned", 1, size=(64, 64))
    (root / "uncaptioned" / "img_000.png").rename(root / "images" / "uncaptioned.png")  # left out: no caption
    (root / "train.log").write_text(train(root, config, "--num-procs", "1"))
    return run_dirs(root)[0]


def test_single_process_overfits(single: Path) -> None:
    seq = losses(single)
    assert sorted(seq) == list(range(1, 31))
    first, last = sum(seq[s] for s in range(1, 6)) / 5, sum(seq[s] for s in range(21, 31)) / 10
    assert last < 0.85 * first, f"loss did not fall: first 5 steps {first:.4f}, last 10 steps {last:.4f}"
    assert (single / "config.toml").is_file() and (single / "run_info.json").is_file()
    resolved = json.loads((single / "resolved_config.json").read_text())
    assert resolved["run"]["gradient_clipping"] == 1.0 and resolved["model"]["sigmoid_scale"] == 1.0
    assert json.loads((single / "run_info.json").read_text())["plugins"]["reference"].startswith("diffpipe-reference")
    assert any((single / "tensorboard").iterdir())
    # 8 samples / (2 per micro-batch x 2 micro-batches) = 2 steps per epoch: a save every 5 epochs = 10 steps
    assert sorted(p.name for p in (single / "saved").iterdir()) == ["final", "step-0000010", "step-0000020"]
    # issue 9.13: the end-of-run line compares the mean loss of the first and last quarter of the steps
    seq30 = [seq[s] for s in range(1, 31)]
    first_q, last_q = quarter_means(single)
    assert first_q == pytest.approx(sum(seq30[:7]) / 7) and last_q == pytest.approx(sum(seq30[-7:]) / 7)
    log = (single.parent.parent / "train.log").read_text()
    assert f"mean loss {first_q:.4f} in the first quarter of steps -> {last_q:.4f} in the last" in log
    # issue 20.13: the file left out is warned about once; 20.21: one bar redraw per step (the log is not a
    # terminal), one line per save
    assert log.count("uncaptioned.png") == 1, log[-3000:]
    assert log.count("\rtrain:") <= 30 + 2, log.count("\rtrain:")
    for step in (10, 20):
        assert log.count(f"diffpipe: step {step}: saved {single}/saved/step-{step:07d}") == 1
    # issue 9.11: the libraries' own chatter stays behind --verbose
    for noise in ("Setting accelerator", "SEED_LAYERS", "Using topology", "built successfully", "UserWarning",
                  "gemm_4bit", "kept in float32", "torchvision"):
        assert noise not in log, f"library output {noise!r} in:\n{log[-3000:]}"


@pytest.fixture(scope="module")
def two_stages(reference_two_stages: Path) -> Path:
    """One uninterrupted run on 2 pipeline stages, checkpointing every 3 steps (shared: see conftest.py)."""
    return reference_two_stages


def test_logged_lr_is_the_lr_the_step_used(two_stages: Path) -> None:
    """Issue 9.9: with warmup_steps = 2 and a cosine schedule over 12 steps, step k (1-based) trains at
    lr * factor(k - 1); the lr read after the scheduler stepped would be one step ahead (and 0 at the end)."""
    factor = lr_lambda("cosine", 2, 12)
    records = [r for r in read_metrics(two_stages) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records:
        assert r["lr"] == pytest.approx(3e-3 * factor(r["step"] - 1), rel=1e-9), r
    assert records[0]["lr"] == pytest.approx(1.5e-3) and records[-1]["lr"] > 0


def test_two_pipeline_stages_match_one_process(single: Path, two_stages: Path) -> None:
    seq = losses(two_stages)
    # Same seed and data: the pipeline split must not change the maths (the LR schedule differs with
    # max_steps, so only the first step, taken at the same warmup LR, is compared exactly).
    assert seq[1] == pytest.approx(losses(single)[1], rel=1e-5)
    assert sorted(seq) == list(range(1, 13)) and all(math.isfinite(v) for v in seq.values())


def test_two_data_parallel_replicas_with_eval(tmp_path: Path) -> None:
    extra = "eval_every_n_steps = 8\nactivation_checkpointing = true\n"  # and bf16 base weights below
    tables = '[[eval_datasets]]\nname = "held"\nconfig = "dataset.toml"\n'
    # and samples shared over the 2 replicas: 3 prompts, so one replica pads its share (issue 14)
    tables += '[sample]\nprompts = ["one", "two", "three"]\nevery_n_steps = 16\nsteps = 2\nresolution = 32\n'
    config = make_project(tmp_path, stages=1, max_steps=16, ckpt=100, extra=extra, tables=tables)
    config.write_text(config.read_text().replace('path = "model"', 'path = "model"\ndtype = "bfloat16"'))
    train(tmp_path, config, "--num-procs", "2")
    run = run_dirs(tmp_path)[0]
    seq = losses(run)
    assert len(seq) == 16 and all(math.isfinite(v) for v in seq.values())
    first, last = sum(seq[s] for s in range(1, 5)) / 4, sum(seq[s] for s in range(13, 17)) / 4
    assert last < first
    info = json.loads((run / "run_info.json").read_text())
    assert info["num_procs"] == 2
    evals = {r["step"]: r["eval"] for r in read_metrics(run) if "eval" in r}
    assert sorted(evals) == [8, 16]
    assert set(evals[8]) == {"held/loss", *(f"held/t_q{q}" for q in ("0.1", "0.3", "0.5", "0.7", "0.9"))}
    # the eval set is the training set here, so held-out loss must fall as the model overfits
    assert evals[16]["held/loss"] < evals[8]["held/loss"]
    samples = sorted(p.name for p in (run / "samples" / "step-0000016").iterdir())
    assert samples == [
        "00-one.png", "01-two.png", "02-three.png", "contact-sheet.png", "latents.safetensors", "prompts.json"
    ]


def test_kill_and_resume_repeats_the_losses(two_stages: Path, tmp_path: Path) -> None:
    """SIGKILL to every process after step 8 of 12 (checkpoints every 3 steps), the newest checkpoint (6) damaged
    too, then --resume: the uninterrupted run's losses."""
    killed_root = tmp_path / "killed"
    expected = losses(two_stages)

    config = make_project(killed_root, stages=2, max_steps=12, ckpt=3)
    env, mark = paused_at(tmp_path, 8, "hold")
    proc = start_diffpipe(["train", "--config", str(config), "--num-procs", "2"], cwd=killed_root, env=env)
    try:
        wait_for_file(mark, proc, what="training reaching step 8")
    finally:
        kill_group(proc)  # SIGKILL to the launcher and every worker
        proc.communicate()
    run = run_dirs(killed_root)[0]
    newest = (run / "checkpoints" / "latest").read_text().strip()
    assert newest == "step-0000006"
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 9))
    # issue 20.4: the newest checkpoint is damaged too (cut short): the resume names it and takes the one before
    damaged = run / "checkpoints" / newest / "params-stage1.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    out = train(killed_root, config, "--num-procs", "2", "--resume")
    assert f"checkpoint {newest} is damaged: {damaged}: 100 bytes" in out, out[-3000:]
    assert f"resuming run {run} from step 3 (step-0000003)" in out
    assert len(run_dirs(killed_root)) == 1
    got = losses(run)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), f"step {step}"
    # issue 9.10: the resume dropped the records after its checkpoint, so each step is logged once
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 13))
    assert len(step_seconds(run)) == 12


def test_sigterm_checkpoints_the_step_and_resume_repeats_the_losses(two_stages: Path, tmp_path: Path) -> None:
    """Issue 20.1: SIGTERM (a scheduler's notice) to a 2-stage run mid-epoch, while step 5 of 12 ends: that step
    finishes, is checkpointed, one line gives the resume command, the exit code is 143; resuming repeats the
    uninterrupted run's losses (``two_stages``, the same config)."""
    config = make_project(tmp_path, stages=2, max_steps=12, ckpt=3)
    env, mark = paused_at(tmp_path, 5, "signal")
    proc = start_diffpipe(["train", "--config", str(config), "--num-procs", "2"], cwd=tmp_path, env=env)
    try:
        wait_for_file(mark, proc, what="training reaching step 5")
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as Kubernetes does
        out, err = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    assert proc.returncode == 143, (out + err)[-3000:]
    run = run_dirs(tmp_path)[0]
    done = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert done == [1, 2, 3, 4, 5]  # the step that was ending, not one more
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000005"  # nothing lost
    lines = [line for line in (out + err).splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 1 and "after step 5 of 12" in lines[0], out + err
    command = shlex.split(lines[0].split("Resume with: ", 1)[1])
    assert command[:2] == ["diffpipe", "train"] and "--resume" in command
    train(tmp_path, Path(command[command.index("--config") + 1]), *command[command.index("--config") + 2 :])
    expected, got = losses(two_stages), losses(run)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), f"step {step}"


OBSERVER = """
import json, sys
from diffpipe_core import hookimpl
from diffpipe_core.engine import forked_workers

LIBRARIES = {"torch", "deepspeed", "peft", "diffusers", "transformers"}  # their own lazy submodules cost little
WHOLE = {"datasets", "pyarrow", "setuptools"}  # any module of these: seconds

@hookimpl
def on_train_end(run_dir, summary):
    # what this forked worker imported that the launcher's preload had not: each costs seconds per worker
    new = [m for m in sys.modules if m not in forked_workers.PRELOADED]
    again = sorted(m for m in new if m in LIBRARIES or m.partition(".")[0] in WHOLE)
    (run_dir / "observer.json").write_text(json.dumps({**summary, "imported_after_fork": sorted(again)}))
"""


def test_resume_on_another_layout_repeats_the_run(two_stages: Path, tmp_path: Path) -> None:
    """Issue 37.2: a run of 2 stages in 2 processes (LoRA dropout 0.1, gradient accumulation 2; the shared
    ``two_stages`` run) resumed from its step-9 checkpoint on 1 stage in 1 process, and on 1 stage with 2 data-parallel
    ranks (accumulation 1: the same global batch), repeats the 2-stage losses: the optimizer and LR-schedule state are
    re-split by parameter name, the data position goes on in the epoch's global order, and the noise and dropout masks
    of each micro-batch come from its global number (the losses drifted by ~1e-3 with a fresh optimizer, and by more
    with the ranks' own RNG streams)."""
    assert "dropout = 0.1" in make_project(tmp_path, stages=2, max_steps=12, ckpt=3).read_text()
    old_root = two_stages.parent.parent
    assert (old_root / "run.toml").read_text() == (tmp_path / "run.toml").read_text()  # the run resumed here
    expected = losses(two_stages)
    for name, procs, accumulation in (("one_stage", 1, 2), ("data_parallel", 2, 1)):
        run = tmp_path / name
        shutil.copytree(two_stages, run)
        resolved = run / "resolved_config.json"
        resolved.write_text(resolved.read_text().replace(str(old_root), str(tmp_path)))  # as if trained here
        shutil.rmtree(run / "checkpoints" / "step-0000012")
        (run / "checkpoints" / "latest").write_text("step-0000009")
        other = make_project(tmp_path, stages=1, max_steps=12, ckpt=3, name=f"{name}.toml")
        other.write_text(other.read_text().replace("accumulation_steps = 2", f"accumulation_steps = {accumulation}"))
        out = train(tmp_path, other, "--resume", str(run), "--num-procs", str(procs))
        assert "pipeline_stages: 2 -> 1" in out and "the weights and the optimizer state are re-split" in out, out
        assert "optimizer state re-split by parameter" in out, out
        got = losses(run)
        assert sorted(got) == list(range(1, 13))
        for step in range(10, 13):
            assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), (name, step, got, expected)


def test_resume_after_editing_the_config(single: Path, tmp_path: Path) -> None:
    """Issue 20.2 and 20.19 on a copy of the finished ``single`` run (30 steps): resuming it unchanged says it is
    finished and changes nothing; a changed LoRA rank is refused naming the key and both values; a higher max_steps
    and a new lr apply (the logged lr is the new one), are announced, and the run folder records the new config."""
    old_root, root = single.parent.parent, tmp_path / "project"
    shutil.copytree(old_root, root, symlinks=True)
    run = root / "out" / single.name
    resolved = run / "resolved_config.json"
    resolved.write_text(resolved.read_text().replace(str(old_root), str(root)))  # as if trained here
    config = root / "run.toml"
    text = config.read_text()
    final = run / "saved" / "final" / "adapter_model.safetensors"
    stamp = final.stat().st_mtime_ns
    # the run's bare name, given from another folder, is found in output_dir
    done = run_diffpipe(["train", "--config", str(config), "--resume", single.name], cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and f"run {run} is finished" in done.stdout, done.output[-2000:]
    assert "step 30 of 30" in done.stdout and final.stat().st_mtime_ns == stamp
    assert "run folder" not in done.output and "caching" not in done.output  # no worker started

    config.write_text(text.replace("rank = 8", "rank = 16"))
    refused = run_diffpipe(["train", "--config", str(config), "--resume"], cwd=root, timeout=120)
    assert refused.returncode == 1 and "Traceback" not in refused.output
    assert "adapter.rank: 8 when the run was trained, 16 now: cannot apply to a resumed run" in refused.stderr

    edited = text.replace("max_steps = 30", "max_steps = 32").replace("lr = 3e-3", "lr = 1e-3")
    config.write_text(edited)
    site = write_plugin_distribution(tmp_path / "site", "diffpipe-observer", {"diffpipe.plugins": {"o": "observer"}},
                                     {"observer": OBSERVER})
    out = train(root, config, "--num-procs", "1", "--resume", env=cli_env([site]))
    observed = json.loads((run / "observer.json").read_text())
    assert observed["steps"] == 2  # generic plugins observe the run's end
    assert observed["imported_after_fork"] == [], observed["imported_after_fork"]  # preload imported them
    assert "optimizer.lr: 0.003 -> 0.001 from step 30" in out and "max_steps: 30 -> 32 from step 30" in out
    factor = lr_lambda("cosine", 2, 32)
    records = {r["step"]: r for r in read_metrics(run) if "loss" in r}
    assert sorted(records) == list(range(1, 33))
    for step in (31, 32):
        assert records[step]["lr"] == pytest.approx(1e-3 * factor(step - 1), rel=1e-9), records[step]
    assert (run / "config.toml").read_text() == edited
    assert (run / "config.until-step-0000030.toml").read_text() == text
    assert json.loads(resolved.read_text())["run"]["optimizer"]["lr"] == 1e-3


def test_saved_lora_reproduces_trained_outputs(single: Path) -> None:
    adapter = single / "saved" / "final"
    state, cfg = read_adapter(adapter)
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 8  # alpha 16 folded into lora_B
    assert all(k.startswith("transformer.") for k in state)
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        trained_alpha = f.metadata()["diffpipe.trained_alpha"]
    assert meta["transformer.lora_alpha"] == 8 and meta["transformer.r"] == 8 and trained_alpha == "16"

    model_dir = single.parent.parent / "model"
    config = read_config(model_dir)
    base = load_file(str(model_dir / "transformer.safetensors"))
    torch.manual_seed(0)
    x, t, text = torch.randn(2, 4, 8, 8), torch.rand(2), torch.randn(2, config.text_len, config.text_dim)

    fresh = TinyDiT(config)
    fresh.load_state_dict(base)
    with torch.no_grad():
        untrained = fresh(x, t, text)
    load_adapter(fresh, adapter)
    fresh.eval()

    # The trained LoRA weights as the checkpoint holds them (float32), applied by peft independently.
    trained = TinyDiT(config)
    trained.load_state_dict(base)
    from diffpipe_core.adapters import apply_lora, lora_config

    apply_lora(trained, lora_config(8, 16, 0.0, cfg["target_modules"]))
    ckpt = sorted((single / "checkpoints").glob("step-*"))[-1]
    params = load_file(str(ckpt / "params-stage0.safetensors"))
    missing, unexpected = trained.load_state_dict(params, strict=False)
    assert not unexpected and all("lora_" not in k for k in missing)
    trained.eval()
    with torch.no_grad():
        expected, got = trained(x, t, text), fresh(x, t, text)
    # saved in bfloat16 (save_dtype default): equal to bf16 precision, and clearly not the base model
    assert torch.allclose(got, expected, atol=2e-2, rtol=2e-2), (got - expected).abs().max()
    assert (expected - untrained).abs().max() > 10 * (got - expected).abs().max()


NAN_PLUGIN = """
import json
import torch
from diffpipe_core import hookimpl

POISON = {}

@hookimpl
def on_train_step_end(step, metrics):
    with open("observed.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "loss": metrics["loss"]}) + "\\n")

@hookimpl(wrapper=True)
def prepare_inputs(batch, context, generator):
    inputs, targets = yield
    if context.step == 3:
        inputs = (inputs[0] * float("nan"),) + tuple(inputs[1:])
    POISON["now"] = context.step == 5  # the last step: its update makes the weights NaN
    return inputs, targets

class Poisoned(torch.optim.AdamW):  # AdamW whose update of the last step writes NaN (a bug, an overflow)
    def step(self, closure=None):
        out = super().step(closure)
        if POISON.get("now"):
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.fill_(float("nan"))
        return out

@hookimpl
def register_optimizers(register):
    register("poisoned_adamw", lambda params, **kw: Poisoned(params, **kw))
"""


def test_non_finite_loss_is_skipped_and_non_finite_weights_never_saved(tmp_path: Path) -> None:
    """A non-finite loss skips its step; weights that became NaN (issue 20.6) are not saved over the last finite
    save: the run stops non-zero naming the tensors."""
    site = write_plugin_distribution(
        tmp_path / "site",
        "diffpipe-nan-injector",
        {"diffpipe.plugins": {"nan": "nan_injector"}},
        {"nan_injector": NAN_PLUGIN},
    )
    config = make_project(tmp_path, stages=1, max_steps=6, ckpt=2, extra="save_every_n_steps = 2\n")
    config.write_text(config.read_text().replace("[optimizer]\n", '[optimizer]\ntype = "poisoned_adamw"\n'))
    result = run_diffpipe(["train", "--config", str(config), "--num-procs", "1"], cwd=tmp_path, timeout=400,
                          env=cli_env([site]))
    out = result.output
    assert "non-finite loss" in out and "at step 4" in out  # context.step is 0-based; the log counts from 1
    assert "img_0" in out.split("non-finite loss", 1)[1].splitlines()[0]  # names the samples
    run = run_dirs(tmp_path)[0]
    seq = losses(run)
    observed = [json.loads(line) for line in (tmp_path / "observed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in observed] == list(range(1, 7))  # generic plugins observe the run
    assert math.isnan(seq[4]) and all(math.isfinite(seq[s]) for s in (1, 2, 3, 5, 6))
    # the weights went NaN in step 6's update: saved/final is not written, the step-4 save and checkpoint stay
    assert result.returncode == 1, out[-3000:]
    error = [line for line in result.stderr.splitlines() if "NaN or infinite" in line]
    assert len(error) == 1 and "NonFiniteWeights" in error[0] and "lora_B.default.weight" in error[0], out[-3000:]
    assert "saved/final not written, saved/step-0000004 is the last finite save" in error[0]
    assert sorted(p.name for p in (run / "saved").iterdir()) == ["step-0000002", "step-0000004"]
    state, _ = read_adapter(run / "saved" / "step-0000004")
    assert all(torch.isfinite(v.float()).all() for v in state.values())
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000004"
    ckpt = load_file(str(run / "checkpoints" / "step-0000004" / "params-stage0.safetensors"))
    assert all(torch.isfinite(v).all() for v in ckpt.values())


def test_full_finetune_on_two_stages_saves_one_shard_per_stage(tmp_path: Path) -> None:
    config = make_project(tmp_path, stages=2, max_steps=4, ckpt=100)
    config.write_text(config.read_text().replace("[adapter]\nrank = 8\nalpha = 16\ndropout = 0.1\n", ""))
    train(tmp_path, config, "--num-procs", "2")
    saved = run_dirs(tmp_path)[0] / "saved" / "final"
    index = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {name: load_file(str(saved / name)) for name in set(index.values())}
    assert sorted(shards) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not set(shards["model-00001-of-00002.safetensors"]) & set(shards["model-00002-of-00002.safetensors"])
    state = {k: v for shard in shards.values() for k, v in shard.items()}
    model = TinyDiT(read_config(tmp_path / "model"))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)  # every tensor, no extras
    base = load_file(str(tmp_path / "model" / "transformer.safetensors"))
    changed = [k for k in base if not torch.equal(base[k].to(torch.bfloat16), state[k])]
    assert len(changed) > len(base) // 2, "full fine-tuning should update most tensors"


def test_adapter_init_from_existing(single: Path, tmp_path: Path) -> None:
    config = make_project(tmp_path, stages=1, max_steps=1, ckpt=100)
    text = config.read_text().replace("dropout = 0.1", f'dropout = 0.1\ninit_from_existing = "{single}/saved/final"')
    config.write_text(text.replace("lr = 3e-3", "lr = 1e-12"))
    train(tmp_path, config, "--num-procs", "1")
    before, _ = read_adapter(single / "saved" / "final")
    after, _ = read_adapter(run_dirs(tmp_path)[0] / "saved" / "final")
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


def grad_norms(run: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in read_metrics(run) if "loss" in r}


def assert_same_training(run: Path, reference: Path) -> None:
    """Same losses, gradient norms and trained adapter as ``reference``, to float tolerance."""
    got, expected = losses(run), losses(reference)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), f"loss at step {step}"
        assert grad_norms(run)[step] == pytest.approx(grad_norms(reference)[step], rel=1e-4), f"grad norm {step}"
    mine, theirs = (load_file(str(r / "saved" / "final" / "adapter_model.safetensors")) for r in (run, reference))
    assert mine.keys() == theirs.keys()
    for key in mine:
        torch.testing.assert_close(mine[key].float(), theirs[key].float(), rtol=1e-2, atol=1e-3, msg=key)


def test_block_swap_and_offloaded_checkpointing_on_two_stages(two_stages: Path, tmp_path: Path) -> None:
    """Issue 10: with 2 stages, swapping 2 blocks per stage and offloading checkpointed block inputs train exactly
    like the plain run (on CPU the swap runs the same code with the CPU as the device)."""
    extra = 'blocks_to_swap = 2\nactivation_checkpointing = "offload"\n'
    config = make_project(tmp_path, stages=2, max_steps=12, ckpt=3, extra=extra)
    output = train(tmp_path, config, "--num-procs", "2")
    assert "blocks_to_swap has no effect without a GPU" in output
    assert_same_training(run_dirs(tmp_path)[0], two_stages)


def test_block_swap_and_checkpointing_on_one_stage(single: Path, tmp_path: Path) -> None:
    extra = "save_every_n_epochs = 5\nblocks_to_swap = 3\nactivation_checkpointing = true\n"
    config = make_project(tmp_path, stages=1, max_steps=30, ckpt=10, extra=extra)
    train(tmp_path, config, "--num-procs", "1")
    assert_same_training(run_dirs(tmp_path)[0], single)
