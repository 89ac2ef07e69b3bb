"""A LoKr trained on Flux through the real CLI (issue 26): the saved ComfyUI file, applied by the ComfyUI-formula
loader, equals the trained model's weights (the adapter from the run's last checkpoint, applied by peft); a run
resumed from its middle checkpoint repeats the losses and writes the same files, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_flux_lokr import comfy_flux_key_map
from test_flux_train import make_project

from diffpipe_core.adapter_kinds import config_from_saved, with_strength
from diffpipe_core.adapters import apply_adapter, read_adapter
from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.testing.comfy import apply_file, merged_weights
from diffpipe_core.testing.golden import folder_manifest
from diffpipe_core.testing.processes import run_diffpipe
from diffpipe_flux.bfl import bfl_to_diffusers, diffusers_to_bfl

pytestmark = pytest.mark.slow

LOKR = """[adapter]
type = "lokr"
rank = 2
alpha = 3
factor = 4
save_formats = ["diffusers", "comfyui"]
"""


def _train(root: Path, *args: str) -> str:
    args = ("train", "--config", str(root / "run.toml"), "--num-procs", "1", *args)
    result = run_diffpipe(list(args), cwd=root, timeout=400)
    assert result.returncode == 0, result.output[-4000:]
    return result.output


@pytest.fixture(scope="module")
def lokr_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float], dict[str, bytes]]:
    """1 process, 4 steps, a checkpoint at step 2; then resumed from that checkpoint. Returns the run folder, the
    uninterrupted run's losses and its saved files (name -> bytes), read before the resume rewrote them."""
    root = tmp_path_factory.mktemp("flux_lokr")
    config = make_project(root, stages=1, single_file=False)
    text = config.read_text().replace("max_steps = 24", "max_steps = 4").replace(
        "checkpoint_every_n_steps = 24", "checkpoint_every_n_steps = 2"
    )
    text = text[: text.index("[adapter]")] + LOKR + text[text.index("[optimizer]") :]
    config.write_text(text)
    _train(root)
    [run] = [p for p in (root / "out").iterdir() if p.is_dir()]
    first = train_losses(run)
    files = saved_files(run / "saved" / "final")
    shutil.copytree(run / "checkpoints" / "step-0000004", root / "uninterrupted-step-4")
    out = _train(root, "--resume", str(run / "checkpoints" / "step-0000002"))
    assert "resuming" in out
    return run, first, files


def saved_files(folder: Path) -> dict[str, object]:
    """What a saved folder holds, comparable across processes: every safetensors file's metadata and tensor
    bytes (safetensors orders the header's metadata differently in each process), the other files' bytes."""
    other = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix != ".safetensors"}
    return {"safetensors": folder_manifest(folder), "other": other}


def test_resumed_lokr_repeats_the_losses_and_files(lokr_run) -> None:
    run, first, files = lokr_run
    assert sorted(first) == [1, 2, 3, 4]
    assert train_losses(run) == first  # exactly: float equality of every step's loss
    assert set(files["safetensors"]) == {"adapter_model.safetensors", "adapter_model.comfyui.safetensors"}
    assert set(files["other"]) == {"adapter_config.json"}
    assert saved_files(run / "saved" / "final") == files
    params = load_file(str(run / "checkpoints" / "step-0000004" / "params-stage0.safetensors"))
    before = load_file(str(run.parent.parent / "uninterrupted-step-4" / "params-stage0.safetensors"))
    assert params.keys() == before.keys() and all(torch.equal(params[k], before[k]) for k in params)


def test_saved_comfyui_lokr_equals_the_trained_weights(lokr_run) -> None:
    run = lokr_run[0]
    from diffusers import FluxTransformer2DModel

    model_dir = run.parent.parent / "model"
    base = FluxTransformer2DModel.from_pretrained(str(model_dir / "transformer"))
    base_bfl = diffusers_to_bfl({k: v.float() for k, v in base.state_dict().items()})
    _, saved_cfg = read_adapter(run / "saved" / "final")
    assert saved_cfg["peft_type"] == "LOKR" and saved_cfg["r"] == 2 and saved_cfg["alpha"] == 2.0  # 3 folded in
    apply_adapter(base, with_strength(config_from_saved(saved_cfg), 3.0))  # the checkpoint holds alpha 3's factors
    params = load_file(str(run / "checkpoints" / "step-0000004" / "params-stage0.safetensors"))
    assert any(".lokr_w2_a." in k for k in params) and any(".lokr_w1." in k for k in params)
    missing, unexpected = base.load_state_dict(params, strict=False)
    assert not unexpected and not [k for k in missing if "lokr_" in k]
    trained = merged_weights(base)
    comfy = load_file(str(run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    got = bfl_to_diffusers(apply_file(base_bfl, comfy, comfy_flux_key_map(2, 2, 32)))
    moved = 0
    for key, value in trained.items():
        assert torch.allclose(got[key], value, atol=1e-6), key
        moved += not torch.equal(value, bfl_to_diffusers(base_bfl)[key])
    assert moved > 0, "training did not change the weights"
