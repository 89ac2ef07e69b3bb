"""diffusion-pipe's keys that diffpipe took over (issue 26): per-resolution micro-batch sizes, eval before the first
step, a checkpoint every N epochs, the epoch in the logs, the pseudo-Huber loss and torch.compile of the blocks.

One 2-process run (2 pipeline stages, so the changing micro-batch size crosses a stage boundary) carries all of
them; the in-process tests check each piece where it is computed.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from diffpipe_core.config import RunConfig
from diffpipe_core.data.sampler import BucketSampler
from diffpipe_core.diffusion import masked_mse, training_loss
from diffpipe_core.engine.run_dir import read_metrics
from diffpipe_core.engine.stage_build import LossFunction, compile_blocks
from diffpipe_core.registry import Registry
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import run_diffpipe
from diffpipe_core.types import LossSettings, TrainingContext

RUN = """
output_dir = "out"
dataset = "dataset.toml"
epochs = 3
micro_batch_size_per_gpu = [[32, 4], [64, 2]]
gradient_accumulation_steps = 2
pipeline_stages = 2
eval_before_first_step = true
eval_every_n_epochs = 1
checkpoint_every_n_epochs = 1
keep_checkpoints = 10
pseudo_huber_c = 0.5
compile = "aot_eager"
seed = 3

[[eval_datasets]]
name = "held"
config = "dataset.toml"

[model]
type = "reference"
path = "model"

[adapter]
rank = 4

[optimizer]
lr = 1e-3
"""


def _base(**keys: object) -> RunConfig:
    return RunConfig(output_dir=Path("o"), dataset=Path("d"), model={"type": "reference"}, **keys)


# ------------------------------------------------------------------------------------------ in-process pieces
def test_micro_batch_size_per_resolution_picks_the_nearest_entry() -> None:
    run = _base(micro_batch_size_per_gpu=[[512, 4], [1024, 1]])
    assert run.micro_batch_size_for(512, 512) == 4
    assert run.micro_batch_size_for(768, 448) == 4  # sqrt(768 x 448) = 587: nearer to 512
    assert run.micro_batch_size_for(1216, 832) == 1
    assert run.default_micro_batch_size == 4
    videos = _base(micro_batch_size_per_gpu=[[512, 2]], image_micro_batch_size_per_gpu=8)
    assert videos.micro_batch_size_for(512, 512, frames=33) == 2 and videos.micro_batch_size_for(512, 512) == 8
    with pytest.raises(ValueError, match="resolution may appear once"):
        _base(micro_batch_size_per_gpu=[[512, 4], [512, 1]])


def test_sampler_cuts_each_bucket_at_its_own_size() -> None:
    groups = [list(range(0, 12)), list(range(12, 18))]
    sampler = BucketSampler(groups, [4, 2], dp_rank=0, dp_world_size=1, seed=0)
    sizes = Counter(len(batch) for batch in sampler.epoch_batches(0))
    assert sizes == {4: 3, 2: 3} and len(sampler) == 6 and sampler.remainder == 0
    for batch in sampler.epoch_batches(1):  # never mixes buckets
        assert len({i >= 12 for i in batch}) == 1
    # the same sampler with one size draws exactly what it drew before per-bucket sizes existed
    one = BucketSampler(groups, 2, 0, 1, seed=0)
    assert one.epoch_batches(0) == BucketSampler(groups, [2, 2], 0, 1, seed=0).epoch_batches(0)


def test_data_report_shows_each_buckets_micro_batch_size() -> None:
    from diffpipe_core.data.items import Bucket, MediaItem, ScanResult
    from diffpipe_core.data.report import format_report

    small, large = Bucket(32, 32), Bucket(64, 64)
    items = [MediaItem(f"{i}.png", Path(f"/d/{i}.png"), "c", small if i < 9 else large, "k") for i in range(14)]
    run = _base(micro_batch_size_per_gpu=[[32, 4], [64, 2]])
    text = format_report(ScanResult(items), lambda b: run.micro_batch_size_for(b.width, b.height, b.frames), 1)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line[:1].isdigit()}
    assert rows["32x32"] == ["1", "9", "4", "2", "1"]  # 9 samples in micro-batches of 4: 2, one left
    assert rows["64x64"] == ["1", "5", "2", "2", "1"]
    assert text.splitlines()[1].split()[:4] == ["resolution", "frames", "items", "micro-batch"]


def test_training_loss_applies_the_runs_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 3, 4, 4, generator=gen), torch.randn(2, 3, 4, 4, generator=gen)
    mask = (torch.rand(2, 1, 4, 4, generator=gen) > 0.5).float()
    ctx = TrainingContext(model_config=None, loss=LossSettings(pseudo_huber_c=0.5))  # type: ignore[arg-type]
    d = pred - target
    expected = ((torch.sqrt(d**2 + 0.25) - 0.5) * mask).sum() / mask.expand_as(d).sum()
    torch.testing.assert_close(training_loss(pred, target, mask, ctx), expected)
    huber = TrainingContext(model_config=None, loss=LossSettings(huber_delta=0.3))  # type: ignore[arg-type]
    torch.testing.assert_close(
        training_loss(pred, target, None, huber), torch.nn.functional.huber_loss(pred, target, delta=0.3)
    )
    plain = TrainingContext(model_config=None)  # type: ignore[arg-type]
    assert torch.equal(training_loss(pred, target, mask, plain), masked_mse(pred, target, mask))  # bit for bit
    assert torch.equal(training_loss(pred, target, mask), masked_mse(pred, target, mask))


def test_loss_keys_reach_the_models_compute_loss_through_the_context(tmp_path: Path) -> None:
    """The pipeline's loss function hands the run's context to compute_loss; the reference plugin (like the
    template) passes it on to training_loss, so pseudo_huber_c changes its loss."""
    registry = Registry()
    registry.load_entry_points()
    plugin = registry.model("reference")
    assert plugin.takes("compute_loss", "context")
    pred, target = torch.full((1, 4, 2, 2), 2.0), torch.zeros(1, 4, 2, 2)
    huber = LossFunction(plugin, TrainingContext(model_config=None, loss=LossSettings(pseudo_huber_c=1.0)))
    mse = LossFunction(plugin, TrainingContext(model_config=None))  # type: ignore[arg-type]
    assert mse((pred,), (target,)).item() == pytest.approx(4.0)
    assert huber((pred,), (target,)).item() == pytest.approx(math.sqrt(5.0) - 1.0)


def test_pseudo_huber_c_is_refused_for_a_model_whose_compute_loss_takes_no_context(tmp_path: Path) -> None:
    from diffpipe_core import hookimpl
    from diffpipe_core.config import load_config
    from diffpipe_core.schema import ConfigError
    from diffpipe_reference import plugin as reference
    from diffpipe_reference.model import write_tiny_model

    class OwnLoss:  # a model plugin computing its own loss (the bundled ones until they take the context)
        model_spec = staticmethod(reference.model_spec)

        @staticmethod
        @hookimpl
        def compute_loss(outputs, targets):  # noqa: ANN001, ANN205
            return outputs[0].mean()  # pragma: no cover - validation refuses the run first

    registry = Registry()
    registry.register_model("reference", OwnLoss(), None, None)
    write_tiny_model(tmp_path / "model")
    write_image_dataset(tmp_path / "images", 1, size=(32, 32))
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "images", resolutions=[32])
    (tmp_path / "run.toml").write_text(
        'output_dir = "out"\ndataset = "dataset.toml"\npseudo_huber_c = 0.5\n[model]\ntype = "reference"\n'
        'path = "model"\n[adapter]\n'
    )
    with pytest.raises(ConfigError, match="pseudo_huber_c: model 'reference' computes its own loss"):
        load_config(tmp_path / "run.toml", registry)
    with pytest.raises(ValueError, match="each a loss; set one"):
        _base(pseudo_huber_c=0.5, huber_delta=1.0)


def test_compile_blocks_compiles_in_place_and_computes_the_same() -> None:
    """compile = true compiles each block layer with torch.compile (on this CPU with the aot_eager backend, which
    runs the same capture and autograd as inductor without minutes of C++ builds): same outputs and gradients,
    same parameter names (so LoRA saving is unchanged)."""
    from diffpipe_core.adapters import apply_lora, lora_config
    from diffpipe_reference.layers import split_into_layers
    from diffpipe_reference.model import TinyDiT, TinyDiTConfig

    torch.manual_seed(0)
    model = TinyDiT(TinyDiTConfig(depth=2))
    apply_lora(model, lora_config(4, 4, 0.0, ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    layers = split_into_layers(model)
    inputs = (torch.randn(2, 4, 8, 8), torch.rand(2), torch.randn(2, 16, 32))

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        h = inputs
        for layer in layers:
            h = layer(h)
        h[0].square().mean().backward()
        return h[0].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    names = [n for n, _ in model.named_parameters()]
    eager_out, eager_grads = run()
    assert compile_blocks(layers, range(len(layers)), ("BlockLayer",), "aot_eager") == 2
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers[1:3])
    assert getattr(layers[0], "_compiled_call_impl", None) is None  # only the blocks
    out, grads = run()
    torch.testing.assert_close(out, eager_out)
    assert grads.keys() == eager_grads.keys() and [n for n, _ in model.named_parameters()] == names
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], msg=name)


# ------------------------------------------------------------------------------------------ one training run
@pytest.fixture(scope="module")
def features_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    from diffpipe_reference.model import write_tiny_model

    root = tmp_path_factory.mktemp("anchor_features")
    write_tiny_model(root / "model")
    write_image_dataset(root / "images", 8, size=(64, 64))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[32, 64])
    (root / "run.toml").write_text(RUN)
    result = run_diffpipe(["train", "--config", str(root / "run.toml"), "--num-procs", "2"], cwd=root, timeout=900)
    assert result.returncode == 0, result.output[-4000:]
    return next(p for p in (root / "out").iterdir() if p.is_dir()), result.output


@pytest.mark.slow
def test_anchor_features_in_one_run(features_run: tuple[Path, str]) -> None:
    run, output = features_run
    records = read_metrics(run)
    steps = [r for r in records if "loss" in r]
    # 8 images at 32 px (micro-batches of 4: 2) and 8 at 64 px (micro-batches of 2: 4) = 6 micro-batches an
    # epoch, 2 per step: 3 steps an epoch, each of 2 micro-batches whose sizes may differ
    assert [r["step"] for r in steps] == list(range(1, 10))
    assert sum(r["samples"] for r in steps) == 3 * 16
    assert {r["samples"] for r in steps} <= {4, 6, 8} and len({r["samples"] for r in steps}) > 1
    assert all(math.isfinite(r["loss"]) for r in steps)
    # the epoch scalar: epochs done, fractional, in metrics.jsonl and TensorBoard
    assert [r["epoch"] for r in steps] == pytest.approx([s / 3 for s in range(1, 10)])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/epoch")] == pytest.approx([s / 3 for s in range(1, 10)])
    # eval before the first step (step 0), then at every epoch's end
    assert [r["step"] for r in records if "eval" in r] == [0, 3, 6, 9]
    # a checkpoint at the end of each epoch (the last one is the end-of-run checkpoint)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == [
        "step-0000003", "step-0000006", "step-0000009"
    ]
    # no library chatter from torch.compile or the rest on a normal run
    for noise in ("UserWarning", "torch._dynamo", "W1", "Setting accelerator", "recompil"):
        assert noise not in output, f"{noise!r} in:\n{output[-3000:]}"
