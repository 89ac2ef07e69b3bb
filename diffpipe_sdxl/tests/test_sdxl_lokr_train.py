"""A LoKr trained on SDXL through the real CLI (issue 26), 1 process from the single-file checkpoint: the saved kohya
file, applied by the ComfyUI-formula loader with ComfyUI's SDXL key map, equals the trained UNet's weights (the
adapter from the run's last checkpoint, applied by peft); resumed from its middle checkpoint, the run repeats the
losses and writes the same files, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file
from test_sdxl_lokr import comfy_sdxl_key_map, sgm
from test_sdxl_train import RUN_TOML

from diffpipe_core.adapter_kinds import config_from_saved, with_strength
from diffpipe_core.adapters import apply_adapter, read_adapter
from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.testing.comfy import apply_file, merged_weights
from diffpipe_core.testing.golden import folder_manifest
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import run_diffpipe

pytestmark = pytest.mark.slow

LOKR = """
[adapter]
type = "lokr"
rank = 2
alpha = 4
factor = 4
save_formats = ["diffusers", "kohya"]
"""


def _train(root: Path, *args: str) -> str:
    result = run_diffpipe(["train", "--config", str(root / "run.toml"), *args], cwd=root, timeout=600)
    assert result.returncode == 0, result.output[-4000:]
    return result.output


def saved_files(folder: Path) -> dict[str, object]:
    """Every safetensors file's metadata and tensor bytes (the header's metadata order differs per process), the
    other files' bytes."""
    other = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix != ".safetensors"}
    return {"safetensors": folder_manifest(folder), "other": other}


@pytest.fixture(scope="module")
def lokr_run(tiny_sdxl: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    folder, file = tiny_sdxl
    root = tmp_path_factory.mktemp("sdxl_lokr")
    write_image_dataset(root / "images", 4, size=(64, 64))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])
    model = f'path = "{file}"\nconfig_path = "{folder}"'
    text = RUN_TOML.format(steps=4, stages=1, model=model, lr=5e-3, adapter=LOKR)
    (root / "run.toml").write_text(text.replace("seed = 11", "seed = 11\ncheckpoint_every_n_steps = 2"))
    _train(root)
    [run] = [p for p in (root / "out").iterdir() if p.is_dir()]
    first = train_losses(run), saved_files(run / "saved" / "final")
    shutil.copytree(run / "checkpoints" / "step-0000004", root / "uninterrupted-step-4")
    _train(root, "--resume", str(run / "checkpoints" / "step-0000002"))
    return run, first


def test_resumed_sdxl_lokr_repeats_the_losses_and_files(lokr_run) -> None:
    run, (losses, files) = lokr_run
    assert sorted(losses) == [1, 2, 3, 4] and train_losses(run) == losses
    assert set(files["safetensors"]) == {"adapter_model.safetensors", "adapter_model.kohya.safetensors"}
    assert saved_files(run / "saved" / "final") == files
    resumed = load_file(str(run / "checkpoints" / "step-0000004" / "params-stage0.safetensors"))
    uninterrupted = load_file(str(run.parent.parent / "uninterrupted-step-4" / "params-stage0.safetensors"))
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_saved_kohya_lokr_equals_the_trained_unet(lokr_run, tiny_sdxl: tuple[Path, Path]) -> None:
    run = lokr_run[0]
    unet = UNet2DConditionModel.from_pretrained(tiny_sdxl[0], subfolder="unet", local_files_only=True)
    base = sgm({k: v.float() for k, v in unet.state_dict().items()}, unet)
    saved = read_adapter(run / "saved" / "final")[1]
    assert saved["r"] == 2 and saved["alpha"] == 2.0  # the trained alpha 4 is folded into the saved factors
    apply_adapter(unet, with_strength(config_from_saved(saved), 4.0))  # the checkpoint holds alpha 4's factors
    params = load_file(str(run / "checkpoints" / "step-0000004" / "params-stage0.safetensors"))
    missing, unexpected = unet.load_state_dict(params, strict=False)
    assert not unexpected and not [k for k in missing if "lokr_" in k]
    expected = sgm(merged_weights(unet), unet)
    kohya = load_file(str(run / "saved" / "final" / "adapter_model.kohya.safetensors"))
    got = apply_file(base, kohya, comfy_sdxl_key_map(list(base)))
    assert sum(not torch.equal(expected[k], base[k]) for k in expected) > 10  # training moved the adapted weights
    for key in expected:
        assert torch.allclose(got[key], expected[key], atol=1e-6), key
