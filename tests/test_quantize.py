"""Issue 10, test 3: quantized base weights (``[model] quantize``). nf4 (bitsandbytes, which runs on CPU) and
float8 (bf16 compute) bases train a LoRA through the real CLI (1 DeepSpeed worker each); the saved adapter and
the checkpoint hold only LoRA tensors. In-process, for nf4, int8 and float8: only the loading stage's blocks are
quantized, outputs stay close to the full-precision model and a LoRA on top learns. A full fine-tune of a
quantized model is refused by validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.adapters import apply_lora, lora_config, lora_state_dict
from diffpipe_core.config import load_config
from diffpipe_core.engine import checkpoint as ckpt_io
from diffpipe_core.engine.model_loading import load_for_stages, materialise_layers
from diffpipe_core.engine.partition import stage_parts
from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.quantize import Float8Linear, quantize_stage
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import run_diffpipe
from diffpipe_reference.model import write_tiny_model

MODES = {"nf4": "float32", "float8": "bfloat16"}  # CLI runs: quantize -> [model] dtype (compute dtype)
STEPS = 6

RUN_TOML = """
output_dir = "out-{mode}"
dataset = "dataset.toml"
max_steps = {steps}
micro_batch_size_per_gpu = 2
gradient_accumulation_steps = 1
seed = 3

[model]
type = "reference"
path = "model"
dtype = "{dtype}"
quantize = "{mode}"
{adapter}
[optimizer]
lr = 3e-3
"""
ADAPTER = "\n[adapter]\nrank = 4\nalpha = 4\n"


def project(root: Path) -> Path:
    if not (root / "model").exists():
        write_tiny_model(root / "model")
        write_image_dataset(root / "images", 4, size=(64, 64))
        write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])
    return root


def write_run(root: Path, mode: str, adapter: str = ADAPTER) -> Path:
    config = root / f"run-{mode}.toml"
    config.write_text(RUN_TOML.format(mode=mode, dtype=MODES[mode], steps=STEPS, adapter=adapter))
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """One short 1-process LoRA run per quantization mode, sharing the model, dataset and cache."""
    root = project(tmp_path_factory.mktemp("quantized"))
    out = {}
    for mode in MODES:
        result = run_diffpipe(
            ["train", "--config", str(write_run(root, mode)), "--num-procs", "1"], cwd=root, timeout=400
        )
        assert result.returncode == 0, result.output[-4000:]
        out[mode] = (next((root / f"out-{mode}").iterdir()), result.output)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_lora_trains_on_quantized_base(runs: dict[str, tuple[Path, str]], mode: str) -> None:
    run, output = runs[mode]
    # 4 blocks x 7 linears (q, k, v, out, fc1, fc2, modulation); embedders and the final layer stay as they are
    assert f"diffpipe: stage 0: 28 linear layers quantized to {mode}" in output
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())

    adapter = load_file(str(run / "saved" / "final" / "adapter_model.safetensors"))
    assert len(adapter) == 4 * 6 * 2  # lora_targets: 6 linears per block, A and B each
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in adapter), sorted(adapter)[:4]
    # lora_B starts at zero: non-zero means the LoRA learned through the quantized base
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if ".lora_B." in k)
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert set(ckpt_io.read_params(ckpt)) == {
        k.removeprefix("transformer.").replace(".weight", ".default.weight") for k in adapter
    }


def test_stage_quantization_and_lora_training_in_process(tmp_path: Path) -> None:
    """Stage 2 of 2: only its blocks are quantized, outputs stay close to full precision, and a LoRA on top
    learns (every mode; the int8 path runs through the CLI nowhere else)."""
    project(tmp_path)
    plugin = get_registry().model("reference")
    base = plugin.spec.config_schema(type="reference", path=tmp_path / "model")
    targets = plugin.require("lora_targets", model_config=base)

    def second_stage(cfg):
        stage = load_for_stages(plugin, cfg, torch.device("cpu"), torch.float32)
        parts = stage_parts(stage.layers, 2)
        own = range(parts[1], parts[2])
        materialise_layers(plugin, cfg, stage, own, torch.device("cpu"))
        summary = quantize_stage(cfg, stage, own, plugin.spec.block_layers)
        return stage, own, summary

    def forward(stage, own):
        torch.manual_seed(0)
        x = (torch.randn(2, 16 + 16, 64), torch.randn(2, 64), torch.tensor([8, 8]))  # [text; image] tokens, c, hw
        for i in own:
            x = stage.layers[i](x)
        return x[0]

    stage, own, summary = second_stage(base)
    with torch.no_grad():
        expected = forward(stage, own)
    assert summary is None
    for mode, cls, tol in (
        ("nf4", "Linear4bit", 0.15),
        ("int8", "Linear8bitLt", 0.02),
        ("float8", "Float8Linear", 0.05),
        ("float8_e5m2", "Float8Linear", 0.1),
    ):
        stage, own, summary = second_stage(base.model_copy(update={"quantize": mode}))
        for i, layer in enumerate(stage.layers):
            kinds = {type(m).__name__ for m in layer.modules()}
            if i in own and type(layer).__name__ == "BlockLayer":
                assert cls in kinds and "Linear" not in kinds, (mode, i, kinds)
            else:  # another stage's blocks (still on meta), embedders and the final layer: untouched
                assert cls not in kinds, (mode, i, kinds)
        blocks = sum(type(stage.layers[i]).__name__ == "BlockLayer" for i in own)
        assert blocks and summary.startswith(f"{7 * blocks} linear layers quantized to {mode}")
        with torch.no_grad():
            out = forward(stage, own)
        assert (out - expected).abs().max() < tol * expected.abs().max(), mode

        apply_lora(stage.model, lora_config(4, 4, 0.0, list(targets)))
        trainable = [p for p in stage.model.parameters() if p.requires_grad and p.device.type != "meta"]
        opt = torch.optim.AdamW(trainable, lr=1e-2)
        target = torch.zeros_like(expected)
        losses = []
        for _ in range(4):
            loss = (forward(stage, own) - target).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (mode, losses)
        state = lora_state_dict(stage.model)
        assert state and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in state), mode


def test_float8_linear_matches_and_lora_wraps_it() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    model = torch.nn.Sequential()
    model.add_module("proj", Float8Linear(linear, torch.bfloat16))
    assert model.proj.weight.dtype == torch.float8_e4m3fn and model.proj.weight_scale.dtype == torch.float32
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert (model(x) - linear(x)).abs().max() < 0.05 * linear(x).abs().max()
        assert model(x).dtype == torch.float32
    apply_lora(model, lora_config(4, 4, 0.0, ["proj"]))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "proj.lora_A.default.weight",
        "proj.lora_B.default.weight",
    }
    assert model.proj.lora_A["default"].weight.dtype == torch.float32
    loss = model(x).square().mean()
    loss.backward()
    assert model.proj.lora_B["default"].weight.grad.abs().sum() > 0
    assert set(lora_state_dict(model)) == {"proj.lora_A.weight", "proj.lora_B.weight"}


def test_float8_e5m2_storage_keeps_weights_e4m3_flushes_to_zero() -> None:
    """diffusion-pipe's transformer_dtype = 'float8_e5m2' (its advice for Cosmos-Predict2): e5m2's wider range
    keeps weights thousands of times smaller than the largest one, which e4m3 under the same per-tensor scale
    rounds to zero."""
    linear = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1e-7)
        linear.weight[0, 0] = 1.0
    e4m3, e5m2 = Float8Linear(linear, torch.float32), Float8Linear(linear, torch.float32, torch.float8_e5m2)
    assert e4m3.weight.dtype == torch.float8_e4m3fn and e5m2.weight.dtype == torch.float8_e5m2
    for layer, kept in ((e4m3, 1), (e5m2, 64 * 64)):
        restored = layer.weight.float() * layer.weight_scale
        assert int((restored != 0).sum()) == kept
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert (e5m2(x) - linear(x)).abs().max() < 0.15 * linear(x).abs().max()


def test_full_finetune_of_quantized_model_is_refused(tmp_path: Path) -> None:
    root = project(tmp_path)
    config = write_run(root, "nf4", adapter="")
    with pytest.raises(ConfigError) as err:
        load_config(config, get_registry())
    message = str(err.value)
    assert "model.quantize: 'nf4' quantizes the frozen base weights" in message and "[adapter]" in message
    assert str(config) in message


def test_float8_linear_keeps_only_its_float8_weight_for_backward() -> None:
    """Autograd through ``weight.to(bf16) * scale`` kept every layer's dequantized bf16 weight until backward: 2 bytes
    a weight held through the forward, more than float8 storage saves. Only the float8 weight may be kept."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512)
    layer = Float8Linear(linear, torch.bfloat16)
    own = {layer.weight.untyped_storage().data_ptr(), layer.weight_scale.untyped_storage().data_ptr()}
    x = torch.randn(4, 256, requires_grad=True)
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    new = sum(t.numel() * t.element_size() for t in kept if t.untyped_storage().data_ptr() not in own)
    assert new < 256 * 512, f"{new} bytes kept for backward: a dequantized weight copy"
    out.square().sum().backward()
    weight = layer.weight.to(torch.bfloat16) * layer.weight_scale.to(torch.bfloat16)
    x_ref = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.linear(x_ref.to(torch.bfloat16), weight, linear.bias.detach().to(torch.bfloat16))
    ref.float().square().sum().backward()
    torch.testing.assert_close(out, ref.float())
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_a_quantized_base_is_read_one_block_at_a_time_as_the_plan_counts(tmp_path: Path) -> None:
    """A stage of a quantized base never holds more than one block's linears at full precision while it loads
    (quantize.load_quantized, as stage_build loads): after every read, the full-precision block linears present are
    one block's at most, and the result is quantize_stage's. The GPU-fit plan counts exactly that block's excess over
    its quantized size as the load's transient, not the stage's whole full-precision weights."""
    from torch import nn

    from diffpipe_core.config import ResolvedConfig, RunConfig
    from diffpipe_core.engine.gpu_fit import Choice, FitSource, _plan
    from diffpipe_core.quantize import load_quantized

    project(tmp_path)
    plugin = get_registry().model("reference")
    cfg = plugin.spec.config_schema(type="reference", path=tmp_path / "model", quantize="float8")
    stage = load_for_stages(plugin, cfg, torch.device("cpu"), torch.float32)
    own = list(range(len(stage.layers)))
    blocks = [i for i in own if type(stage.layers[i]).__name__ == "BlockLayer"]

    def full_precision(i: int) -> int:
        return sum(m.weight.numel() * 4 for m in stage.layers[i].modules()
                   if type(m) is nn.Linear and m.weight.device.type != "meta")  # fmt: skip

    held: list[int] = []

    def load(indices: list[int]) -> None:
        materialise_layers(plugin, cfg, stage, indices, torch.device("cpu"))
        held.append(sum(full_precision(i) for i in blocks))

    summary = load_quantized(cfg, stage, own, plugin.spec.block_layers, load)
    one_block = max(sum(m.weight.numel() * 4 for m in stage.layers[i].modules() if isinstance(m, Float8Linear))
                    for i in blocks)  # fmt: skip
    assert len(held) == 1 + len(blocks) and held[0] == 0 and 0 < max(held) <= one_block, (held, one_block)
    assert summary is not None and summary.startswith(f"{7 * len(blocks)} linear layers quantized to float8")
    assert all(full_precision(i) == 0 for i in blocks)  # every block quantized, as quantize_stage leaves them

    run = RunConfig.model_validate({"dataset": "dataset.toml", "model": {"type": "reference", "path": "model"},
                                    "adapter": {"rank": 4}})  # fmt: skip
    source = FitSource(ResolvedConfig(tmp_path / "run.toml", run, cfg, {}), plugin)
    plan = _plan(source, Choice(1, False, 0, "float8"), on_gpu=True)
    full, quantized = source.costs(None).layers, source.costs("float8").layers
    excess = max(full[k].weight_bytes - quantized[k].weight_bytes for k in blocks)
    base = _plan(source, Choice(1, False, 0, None), on_gpu=True).stages[0].load_bytes  # merge_adapters: none
    assert plan.stages[0].load_bytes - base == excess > 0
    assert plan.stages[0].load_bytes < sum(c.weight_bytes for c in full) - plan.stages[0].weight_bytes
