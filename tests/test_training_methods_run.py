"""Issue 42, the weights half, in real training runs (DeepSpeed on gloo, the real cache, peft): one 1-stage run and one
2-stage run with every method on at once ([ema], merge_adapters, cfg, exclude_modules, a name-pattern group_lr),
and a resume of the 1-stage run from its middle checkpoint that repeats every loss and the EMA."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_train import make_project, run_dirs, train

from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.testing.runs import checkpoint_params, stage_files
from diffpipe_reference.model import TinyDiTConfig

pytestmark = pytest.mark.slow

def write_merged_lora(path: Path) -> Path:
    """A LoRA of the reference model (diffusers layout, alpha 4 for rank 2 in a .alpha tensor) to merge."""
    dim = TinyDiTConfig().dim
    gen = torch.Generator().manual_seed(5)
    shapes = {"blocks.0.fc2": (dim, 2 * dim), "blocks.1.attn.to_q": (dim, dim), "blocks.2.fc1": (2 * dim, dim)}
    tensors = {}
    for module, (rows, cols) in shapes.items():
        tensors[f"transformer.{module}.lora_A.weight"] = torch.randn(2, cols, generator=gen) * 0.2
        tensors[f"transformer.{module}.lora_B.weight"] = torch.randn(rows, 2, generator=gen) * 0.2
        tensors[f"transformer.{module}.alpha"] = torch.tensor(4.0)
    save_file(tensors, str(path))
    return path


def methods_project(root: Path, stages: int, max_steps: int, ckpt: int, model: str = "") -> Path:
    config = make_project(root, stages=stages, max_steps=max_steps, ckpt=ckpt, tables=(
        "\n[ema]\ndecay = 0.8\nstart_step = 1\nevery_n_steps = 2\ndevice = 'cpu'\n"))
    write_merged_lora(root / "distill.safetensors")
    text = config.read_text()
    text = text.replace('timestep_sample_method = "uniform"\n', 'timestep_sample_method = "uniform"\ncfg = 3.0\n'
                        f'merge_adapters = [{{ path = "distill.safetensors", weight = 0.5 }}]\n{model}')
    text = text.replace("dropout = 0.1\n", "dropout = 0.1\nexclude_modules = ['^blocks\\.3\\.']\n")
    text = text.replace("lr = 3e-3\n", 'lr = 3e-3\ngroup_lr = { "*.fc2.*" = 1e-3 }\n')
    config.write_text(text)
    return config


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The 1-stage run with every method: (project, run folder, output)."""
    root = tmp_path_factory.mktemp("methods")
    config = methods_project(root, stages=1, max_steps=8, ckpt=4)
    out = train(root, config, "--num-procs", "1")
    return root, run_dirs(root)[0], out


def test_every_method_on_one_stage(one_stage: tuple[Path, Path, str]) -> None:
    root, run, out = one_stage
    assert "stage 0: merged 1 adapter(s) into the base (3 module updates)" in out, out[-3000:]
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 9)) and all(v == v for v in losses.values())
    saved, ema = load_file(str(run / "saved/final/adapter_model.safetensors")), None
    ema = load_file(str(run / "saved/final/ema/adapter_model.safetensors"))
    # exclude_modules: no adapter on block 3, every other target adapted; the merged LoRA is not saved with it
    modules = {k.split(".lora_")[0].removeprefix("transformer.") for k in saved}
    assert modules == {f"blocks.{b}.{m}" for b in (0, 1, 2)
                       for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out", "fc1", "fc2")}
    # EMA: saved beside the weights in the same format and keys, not equal to them; the checkpoint holds it too
    assert ema.keys() == saved.keys() and (run / "saved/final/ema/adapter_config.json").is_file()
    assert any(not torch.equal(ema[k], saved[k]) for k in saved)
    params = checkpoint_params(run)
    trained = [k for k in params if not k.startswith("ema/")]
    assert sorted(k for k in params if k.startswith("ema/")) == sorted(f"ema/{k}" for k in trained)
    for key in trained:
        bare = "transformer." + key.replace(".default", "")
        scale = 2.0 if ".lora_B." in key else 1.0  # saved files have alpha 16 / rank 8 folded into lora_B
        assert torch.allclose((params[f"ema/{key}"] * scale).to(torch.bfloat16).float(), ema[bare].float()), key
    # group_lr pattern: its own parameter group at its lr, holding exactly the fc2 tensors
    state = torch.load(run / "checkpoints/step-0000008/optimizer-stage0.pt", weights_only=True)
    groups = state["optimizer"]["param_groups"]
    names = state["param_names"]
    pattern = next(g for g in groups if g["name"] == "*.fc2.*")
    assert pattern["initial_lr"] == 1e-3 and {names[i] for i in pattern["params"]} == {n for n in names if ".fc2." in n}


def test_resume_repeats_every_loss_and_the_ema(one_stage: tuple[Path, Path, str], tmp_path: Path) -> None:
    """The run resumed from its step-4 checkpoint logs the uninterrupted run's losses for steps 5..8 (the CFG pass's
    noise, the merged base and the pattern group all the same) and saves the same EMA."""
    root, run, _ = one_stage
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-0000008")
    shutil.rmtree(resumed / "saved")
    (resumed / "checkpoints" / "latest").write_text("step-0000004")
    train(root, root / "run.toml", "--num-procs", "1", "--resume", str(resumed))
    expected, got = train_losses(run), train_losses(resumed)
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    first = load_file(str(run / "saved/final/ema/adapter_model.safetensors"))
    again = load_file(str(resumed / "saved/final/ema/adapter_model.safetensors"))
    for key in first:
        assert torch.allclose(first[key].float(), again[key].float(), atol=1e-6), key


def test_every_method_on_two_stages(tmp_path: Path) -> None:
    """The methods on 2 stages, on a float8-quantized base: the adapters merge into each stage's weights before they
    are quantized (merging into a kept float8 weight is refused, so the run would stop otherwise)."""
    config = methods_project(tmp_path, stages=2, max_steps=4, ckpt=2, model='quantize = "float8"\n')
    out = train(tmp_path, config, "--num-procs", "2")
    assert "stage 0: merged 1 adapter(s) into the base (1 module updates)" in out, out[-3000:]
    assert "stage 1: merged 1 adapter(s) into the base (2 module updates)" in out, out[-3000:]
    run = run_dirs(tmp_path)[0]
    losses = train_losses(run)
    assert sorted(losses) == [1, 2, 3, 4] and all(v == v for v in losses.values())
    assert stage_files(run) == ["params-stage0.safetensors", "params-stage1.safetensors"]
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    for stage in (0, 1):  # each stage checkpoints the EMA of its own tensors
        params = load_file(str(ckpt / f"params-stage{stage}.safetensors"))
        trained = [k for k in params if not k.startswith("ema/")]
        assert trained and sorted(k for k in params if k.startswith("ema/")) == sorted(f"ema/{k}" for k in trained)
    saved = load_file(str(run / "saved/final/adapter_model.safetensors"))
    ema = load_file(str(run / "saved/final/ema/adapter_model.safetensors"))
    assert ema.keys() == saved.keys() and not any(".blocks.3." in k for k in saved)
