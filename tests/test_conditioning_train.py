"""Issue 19, conditioned training end to end through the real CLI (DeepSpeed on gloo, the real cache, peft LoRA):
the reference model trained on edit pairs (``reference-edit``) and image-to-video (``reference-i2v``, test 5), one
short 1-process run each. A generic observer plugin records what reached ``prepare_inputs`` and the first layer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.testing.media import write_png, write_video
from diffpipe_core.testing.processes import cli_env, run_diffpipe, write_plugin_distribution
from diffpipe_reference.model import write_tiny_model

pytestmark = pytest.mark.slow

RUN_TOML = """
output_dir = "out"
dataset = "dataset.toml"
max_steps = 4
micro_batch_size_per_gpu = 2
gradient_accumulation_steps = 1
pipeline_stages = 1
checkpoint_every_n_steps = 100
seed = 3

[model]
type = "{model}"
path = "model"

[adapter]
rank = 4
alpha = 4

[optimizer]
lr = 1e-2
"""

OBSERVER = '''
import json
from diffpipe_core import hookimpl

@hookimpl(wrapper=True)
def prepare_inputs(batch, context, generator):
    inputs, targets = yield
    record = {{"batch": {{k: list(v.shape) for k, v in sorted(batch.items())}}, "first_input": list(inputs[0].shape)}}
    with open({log!r}, "a") as f:
        f.write(json.dumps(record) + "\\n")
    return inputs, targets
'''


def project(root: Path, model: str) -> tuple[Path, dict[str, str]]:
    """Model folder, run config, and the environment that installs both test models and the observer."""
    root.mkdir(parents=True, exist_ok=True)
    write_tiny_model(root / "model")
    (root / "run.toml").write_text(RUN_TOML.format(model=model))
    site = write_plugin_distribution(
        root / "site",
        "diffpipe-reference-conditioned",
        {"diffpipe.models": {"reference-edit": "diffpipe_reference.edit", "reference-i2v": "diffpipe_reference.i2v"},
         "diffpipe.plugins": {"batch-observer": "batch_observer"}},
        {"batch_observer": OBSERVER.format(log=str(root / "batches.jsonl"))},
    )
    return root / "run.toml", cli_env([site])


def trained(root: Path, env: dict[str, str]) -> tuple[Path, list[dict]]:
    result = run_diffpipe(["train", "--config", "run.toml", "--num-procs", "1"], cwd=root, timeout=400, env=env)
    assert result.returncode == 0, result.output[-4000:]
    (run,) = sorted(p for p in (root / "out").iterdir() if p.is_dir())
    losses = train_losses(run)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values()), losses
    lora = load_file(str(run / "saved" / "final" / "adapter_model.safetensors"))
    up = [v for k, v in lora.items() if "lora_B" in k or "lora_up" in k]
    assert up and any(v.abs().sum() > 0 for v in up), "the adapter did not train"  # peft starts lora_B at 0
    return run, [json.loads(line) for line in (root / "batches.jsonl").read_text().splitlines()]


def test_edit_pairs_train_with_control_latents_beside_the_target(tmp_path: Path) -> None:
    config, env = project(tmp_path, "reference-edit")
    for folder in ("data", "control", "plain"):
        (tmp_path / folder).mkdir()
    for i in range(4):
        write_png(tmp_path / "data" / f"t{i}.png", 64, 64, seed=i)
        (tmp_path / "data" / f"t{i}.txt").write_text(f"make it {i}", encoding="utf-8")
        if i < 3:  # t3 has no control image: left out
            write_png(tmp_path / "control" / f"t{i}.jpg", 96, 64, seed=50 + i)
    for i in range(2):  # plain text-to-image items train beside the edit pairs
        write_png(tmp_path / "plain" / f"p{i}.png", 64, 64, seed=20 + i)
        (tmp_path / "plain" / f"p{i}.txt").write_text(f"plain {i}", encoding="utf-8")
    (tmp_path / "dataset.toml").write_text('resolutions = [64]\n[[directory]]\npath = "data"\ncontrol_path = '
                                           '"control"\n[[directory]]\npath = "plain"\n')

    listing = run_diffpipe(["data", "--config", "run.toml", "--num-procs", "1"], cwd=tmp_path, env=env, timeout=120)
    assert listing.returncode == 0, listing.output
    assert any(str(tmp_path / "data" / "t3.png") in line and "no control image" in line
               for line in listing.stdout.splitlines()), listing.stdout
    assert "Edit pairs: 3 items with control images, 2 items without." in listing.stdout

    _, batches = trained(tmp_path, env)
    edit = [b for b in batches if "control_0_latents" in b["batch"]]
    plain = [b for b in batches if "control_0_latents" not in b["batch"]]
    assert edit and plain  # 3 pairs (one micro-batch of 2 per epoch) and 2 plain items
    for b in edit:
        assert b["batch"]["control_0_latents"] == b["batch"]["latents"] == [2, 4, 8, 8]
        assert b["first_input"] == [2, 4, 8, 16]  # [noisy target | clean control] reached the first layer
    assert all(b["first_input"] == [2, 4, 8, 8] for b in plain)


def test_image_to_video_trains_on_the_decoded_first_frame_and_refuses_images(tmp_path: Path) -> None:
    config, env = project(tmp_path, "reference-i2v")
    for i in range(4):
        write_video(tmp_path / "clips" / f"clip{i}.mp4", frames=6, fps=8, size=(32, 32), seed=i)
        (tmp_path / "clips" / f"clip{i}.txt").write_text(f"clip {i}", encoding="utf-8")
    (tmp_path / "dataset.toml").write_text('resolutions = [32]\nframe_buckets = [5]\n[[directory]]\npath = "clips"\n')

    _, batches = trained(tmp_path, env)
    for b in batches:
        assert b["batch"] == {"first_frame_latents": [2, 4, 4, 4], "image_embeds": [2, 32], "latents": [2, 4, 5, 4, 4],
                              "text_embeds": [2, 16, 32]}
        assert b["first_input"] == [2, 4, 4, 24]  # [first frame | 5 noisy frames] side by side

    still = tmp_path / "clips" / "still.png"
    write_png(still, 32, 32)
    still.with_suffix(".txt").write_text("a still", encoding="utf-8")
    result = run_diffpipe(["validate", "--config", "run.toml", "--num-procs", "1"], cwd=tmp_path, env=env,
                          timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.output
    assert "model 'reference-i2v' trains image-to-video only" in result.stderr and str(still) in result.stderr
