"""The GPU proof's tests (``bench/gpu_proof.sh``): the paths users pay for on a GPU, each against the CPU's result.

Every test runs on ``device``: its ``cuda`` case is marked ``cuda`` (the proof script selects them with
``-m cuda``; without a CUDA device they skip) and its ``cpu`` case is the twin that runs in the suite on every
machine, so a broken import or path shows up before a GPU is lent. Where the CPU can compute the result, the
``cuda`` case compares with it (TF32 off, so float32 matmuls are float32 on both). This module and
``proof_train_worker.py`` import only what the proof carries to the GPU machine (``bench/proof_wheels.txt``;
``test_gpu_proof.py`` checks that), so no cache (HF datasets) and no subprocess ``diffpipe`` here.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_memory import lora_model, run

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.engine.launcher import free_port, local_rank_env
from diffpipe_core.memory import SwappedBlock, wrap_stage_layers
from diffpipe_core.optim.kahan import COMPENSATION
from diffpipe_core.quantize import quantize_stage
from diffpipe_core.testing.processes import cli_env, run_ranks
from diffpipe_core.testing.sampling import registered, sample_latents
from diffpipe_core.types import SampleRequest

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("proof_train_worker.py")
CPU = torch.device("cpu")
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="no CUDA device: the GPU half, run by bench/gpu_proof.sh; its CPU twin runs here",
            ),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """Each test's device; on CUDA with TF32 off, so its float32 results can be compared with the CPU's."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield torch.device(request.param)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on(device: torch.device, layers: list[torch.nn.Module]) -> None:
    """Move the (possibly wrapped) layers to ``device``, as PipelineModule does (a swapped block's weights stay in
    host memory)."""
    for layer in layers:
        layer.to(device)


@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_block_swap_and_offload_give_the_cpu_result(device: torch.device, checkpointing: bool | str) -> None:
    """Block swap (side-stream copies into the device) with activation checkpointing, plain or offloaded to pinned
    host memory: the same loss and gradients as the plain layers on the same device and as the CPU."""
    model, layers = lora_model()
    cpu_loss, cpu_grads = run(layers, model)
    on(device, layers)
    plain_loss, plain_grads = run(layers, model, device)
    wrapped, swapped = wrap_stage_layers(layers, range(len(layers)), ("BlockLayer",), checkpointing, 3, device)
    on(device, wrapped)
    blocks = [w for w in wrapped if isinstance(w, SwappedBlock)]
    assert swapped == 3 and len(blocks) == 3
    loss, grads = run(wrapped, model, device)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss, cpu_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == plain_grads.keys() == cpu_grads.keys() and len(grads) == 16
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(grad, cpu_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    swapper = blocks[0].swapper
    for block in swapper.blocks:  # between uses, swapped weights live in (pinned, on a GPU) host memory
        assert not block.loaded and all(p.device.type == "cpu" for p in block.params)
        assert all(p.is_pinned() for p in block.params) == (device.type == "cuda")


def quantized_lora_model(kind: str) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The reference model with every block linear kept quantized as a quantized file leaves it (``"fp8_scaled"``: a
    :class:`ScaledLinear` of float8 weights and their scale; ``"gguf_Q8_0"``: a :class:`GGUFLinear` of GGUF blocks)
    and a LoRA (non-zero) on ``to_q`` and ``fc1``, split into its layers."""
    import gguf

    from diffpipe_core.quantize import Float8Linear, GGUFLinear
    from diffpipe_reference.layers import split_into_layers
    from diffpipe_reference.model import TinyDiT, TinyDiTConfig

    torch.manual_seed(0)
    model = TinyDiT(TinyDiTConfig(dim=32, depth=4, heads=2)).requires_grad_(False)
    for block in model.blocks:
        for name, linear in [(n, m) for n, m in block.named_modules() if type(m) is torch.nn.Linear]:
            if kind == "fp8_scaled":
                kept: torch.nn.Module = Float8Linear(linear, torch.float32)
            else:
                kept = GGUFLinear.like(linear, "Q8_0", torch.float32)
                raw = gguf.quants.quantize(linear.weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
                kept.weight.copy_(torch.from_numpy(raw))
            parent, _, child = name.rpartition(".")
            setattr(block.get_submodule(parent), child, kept)
    apply_lora(model, lora_config(4, 4, 0.0, ["to_q", "fc1"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return model, split_into_layers(model)


@pytest.mark.parametrize("kind", ["fp8_scaled", "gguf_Q8_0"])
def test_block_swap_moves_a_quantized_bases_stored_weights(device: torch.device, kind: str) -> None:
    """Block swap over a base kept quantized (ComfyUI's fp8 scaled files, ``[model] quantize = "float8"``, GGUF): the
    stored weights and scales are what moves between host and device (swapped out between uses, not left on the
    device by the stage's move, not dequantized), they come back unchanged, and the LoRA's loss and gradients are
    those of the unswapped layers on the device and of the CPU."""
    from diffpipe_core.quantize import GGUFLinear, ScaledLinear

    model, layers = quantized_lora_model(kind)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear | GGUFLinear)}
    stored = {f"{n}.{b}": t.clone() for n, m in quantized.items() for b, t in m.named_buffers(recurse=False)}
    assert len(quantized) == 28 and {t.dtype for t in stored.values()} >= {
        "fp8_scaled": {torch.float8_e4m3fn}, "gguf_Q8_0": {torch.uint8}}[kind]  # fmt: skip
    cpu_loss, cpu_grads = run(layers, model)
    on(device, layers)
    plain_loss, plain_grads = run(layers, model, device)
    wrapped, swapped = wrap_stage_layers(layers, range(len(layers)), ("BlockLayer",), False, 3, device)
    on(device, wrapped)
    swapper = next(w for w in wrapped if isinstance(w, SwappedBlock)).swapper
    moved = [t for block in swapper.blocks for t in block.params]
    in_swapped = {n: m for n, m in quantized.items() if any(m.weight is t for t in moved)}
    assert swapped == 3 and len(in_swapped) == 21  # the 7 linears of each of the 3 swapped blocks
    loss, grads = run(wrapped, model, device)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss, cpu_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == plain_grads.keys() == cpu_grads.keys() and len(grads) == 16
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(grad, cpu_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    for name, module in quantized.items():  # between uses, a swapped block's stored weights are in host memory
        where = "cpu" if name in in_swapped else device.type
        for buffer, value in module.named_buffers(recurse=False):
            assert value.device.type == where, (name, buffer)
            assert value.dtype == stored[f"{name}.{buffer}"].dtype
            bits = value.cpu().reshape(-1).view(torch.uint8)
            assert torch.equal(bits, stored[f"{name}.{buffer}"].reshape(-1).view(torch.uint8)), (name, buffer)
            if name in in_swapped:
                assert value.is_pinned() == (device.type == "cuda"), (name, buffer)


@pytest.mark.parametrize("mode, tol", [("nf4", 0.15), ("int8", 0.02), ("float8", 0.05)])
def test_quantized_base_is_close_to_the_cpu_model_and_lora_learns(device: torch.device, mode: str, tol: float) -> None:
    """``[model] quantize`` on the device (bitsandbytes' nf4 / int8 kernels, float8 storage): the stage's outputs
    stay within ``tol`` of the full-precision model computed on the CPU, and a LoRA on top learns."""
    from diffpipe_core.engine.model_loading import StageModel
    from diffpipe_reference.layers import split_into_layers
    from diffpipe_reference.model import TinyDiT, TinyDiTConfig

    def stage_on(where: torch.device) -> StageModel:
        torch.manual_seed(0)
        model = TinyDiT(TinyDiTConfig(dim=64, depth=2, heads=4)).requires_grad_(False).to(where)
        return StageModel(model, split_into_layers(model), True)

    def forward(stage: StageModel, where: torch.device) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(2, 4, 16, 16, generator=g), torch.rand(2, generator=g), torch.randn(2, 16, 32, generator=g))
        out = tuple(t.to(where) for t in x)
        for layer in stage.layers:
            out = layer(out)
        return out[0]

    with torch.no_grad():
        expected = forward(stage_on(CPU), CPU)
    stage = stage_on(device)
    settings = type("Settings", (), {"quantize": mode, "dtype": "float32"})()
    summary = quantize_stage(settings, stage, range(len(stage.layers)), ("BlockLayer",))  # type: ignore[arg-type]
    assert summary is not None and summary.startswith(f"14 linear layers quantized to {mode}")
    kinds = {type(m).__name__ for m in stage.model.modules()}
    assert {"nf4": "Linear4bit", "int8": "Linear8bitLt", "float8": "Float8Linear"}[mode] in kinds
    with torch.no_grad():
        out = forward(stage, device).float().cpu()
    assert (out - expected).abs().max() < tol * expected.abs().max(), mode
    apply_lora(stage.model, lora_config(4, 4, 0.0, ["to_q", "to_v", "fc1"]))
    stage.model.to(device)
    lora = [p for p in stage.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(lora, lr=1e-2)
    losses = []
    for _ in range(5):
        loss = forward(stage, device).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (mode, losses)


def test_kahan_optimizer_step_matches_the_cpu(device: torch.device) -> None:
    """``adamw8bit_kahan`` (bitsandbytes' 8-bit kernel, on the device) keeps learning below bf16 resolution,
    and takes the steps the CPU takes."""
    from diffpipe_core.config import OptimizerConfig
    from diffpipe_core.optim import build_optimizer
    from diffpipe_core.registry import Registry

    def descend(where: torch.device) -> torch.Tensor:
        p = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16, device=where))
        cfg = OptimizerConfig(type="adamw8bit_kahan", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))
        opt = build_optimizer(cfg, [p], Registry().pm)
        for _ in range(10):
            comp = opt.state.get(p, {}).get(COMPENSATION)
            value = p.detach().float() + (comp.float() if comp is not None else 0)
            p.grad = (2 * (value - 1.02)).to(p.dtype)
            opt.step()
        return (p.detach().float() + opt.state[p][COMPENSATION].float()).cpu()

    value = descend(device)
    assert 1.006 < value.mean().item() < 1.02  # steps 8x below bf16's spacing at 1.0 added up
    torch.testing.assert_close(value, descend(CPU), rtol=0, atol=2e-4)


def test_compiled_blocks_give_the_eager_result(device: torch.device) -> None:
    """``compile`` (torch.compile of the block layers: inductor on a GPU; aot_eager on the CPU twin, where inductor
    would need minutes of C++ compiling) gives the eager loss and LoRA gradients."""
    from diffpipe_core.engine.stage_build import compile_blocks

    model, layers = lora_model()
    on(device, layers)
    eager_loss, eager_grads = run(layers, model, device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    assert compile_blocks(layers, range(len(layers)), ("BlockLayer",), backend) == 4
    loss, grads = run(layers, model, device)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-3, atol=1e-4, msg=name)


def test_sampling_on_the_device_gives_the_cpu_sample(device: torch.device, tmp_path: Path) -> None:
    """The denoising loop with classifier-free guidance, the reference model on the device: the CPU's sample."""
    from diffpipe_core.sampling.prompts import encode_prompts
    from diffpipe_reference import plugin as reference
    from diffpipe_reference.model import write_tiny_model

    plugin = registered(reference)
    cfg = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp_path / "model"))
    request = SampleRequest(width=64, height=64, steps=4)
    (texts,) = encode_prompts(plugin, cfg, ["a red square"], "blurry", CPU)
    ours = sample_latents(plugin, cfg, request, texts, seed=3, cfg_scale=2.0, device=device)
    torch.testing.assert_close(ours, sample_latents(plugin, cfg, request, texts, 3, 2.0), rtol=1e-4, atol=1e-5)


def train(folders: dict[str, Path], where: str, out: Path, stages: int = 1, **keys: object) -> dict[str, dict]:
    """Train each model through ``proof_train_worker.py`` (one process per stage); rank 0's losses by model."""
    port = free_port()
    extra = {"OMP_NUM_THREADS": "1"}
    if where == "cpu":
        extra["CUDA_VISIBLE_DEVICES"] = ""  # else DeepSpeed's accelerator is the GPU even for a CPU run
    envs = [cli_env([REPO], **local_rank_env(rank, stages, port), **extra) for rank in range(stages)]
    models = [f"{name}={folder}" for name, folder in folders.items()]
    argv = [sys.executable, str(WORKER), where, str(stages), "4", str(out), json.dumps(keys), *models]
    codes = run_ranks(argv, envs, out, timeout=300)
    assert codes == [0] * stages, (codes, (out / "log0.txt").read_text()[-4000:])
    return {name: json.loads((out / f"losses-{name}.json").read_text()) for name in folders}


def test_one_process_training_matches_the_cpu(device: torch.device, tmp_path: Path) -> None:
    """LoRA runs built as ``diffpipe train`` builds them (DeepSpeed pipeline engine, NCCL on a GPU, gloo on the CPU),
    with checkpointing and 1 swapped block, of the reference model and of a Flux-shaped model: 4 steps each, finite
    losses, and on a GPU the CPU's losses; with two GPUs, 2 stages over NCCL give them too."""
    from diffpipe_flux.testing import write_tiny_flux
    from diffpipe_reference.model import write_tiny_model

    folders = {"reference": write_tiny_model(tmp_path / "reference"), "flux": write_tiny_flux(tmp_path / "flux")}
    keys = {"activation_checkpointing": True, "blocks_to_swap": 1}
    got = train(folders, device.type, tmp_path / "run", **keys)
    for name, result in got.items():
        values = result["losses"] + result["grad_norms"]
        assert len(result["losses"]) == 4 and all(math.isfinite(v) for v in values), (name, result)
        assert result["device"].startswith(device.type)
    if device.type == "cuda":
        cpu = train(folders, "cpu", tmp_path / "cpu", **keys)
        for name in folders:
            torch.testing.assert_close(got[name]["losses"], cpu[name]["losses"], rtol=1e-3, atol=1e-5, msg=name)
        if torch.cuda.device_count() >= 2:
            two = train(folders, "cuda", tmp_path / "two", stages=2, **keys)
            for name in folders:
                torch.testing.assert_close(two[name]["losses"], cpu[name]["losses"], rtol=1e-3, atol=1e-5, msg=name)
