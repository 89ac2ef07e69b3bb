"""MiniMax H3's pruned (curve-form) checkpoint, as diffusion-pipe's example names it
(``minimax_h3_fl2va_pruned_int8_convrot.safetensors``): ``adaln_t_table`` in place of the time MLP, every AdaLN
projection reduced to the table's width. Written from the tiny full model the way the releases are made
(``table = G V_r``, ``W V_r``; ``r`` = the time embedding's width, so exact), it computes the full model's layers at
the table's grid times (and within its interpolation error between), whole and per stage; its int8 "convrot" form
stays quantized with a LoRA on top. The shared run (``test_minimax_train.py``) trains on such a file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_minimax_model import PATCH, forward

from diffpipe_minimax.packing import layout, model_times, patchify
from diffpipe_minimax.plugin import plugin as minimax
from diffpipe_minimax.testing import PRUNED_QUANTIZED, pruned_file

CPU = torch.device("cpu")
GRID = 65


def config(folder: Path, **keys: object):
    return minimax.spec.config_schema(**{"type": "minimax-h3", "path": folder, "dtype": "float32",
                                         "encoder_dtype": "float32", **keys})


@pytest.fixture(scope="module")
def pruned(tiny_minimax: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pruned_file(tiny_minimax, tmp_path_factory.mktemp("pruned") / "minimax_h3_fl2va_pruned.safetensors", GRID)


SHAPE, AUDIO_LEN, TEXT_LEN = (2, 4, 4), 5, 6  # 2 latent frames of 4 x 4, 5 audio latents, 6 text tokens


def item(times: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first layer's inputs of one item at the video time ``times[0]`` and the audio time ``times[1]`` (the
    model's ``1 - sigma``)."""
    g = torch.Generator().manual_seed(3)
    lay = layout(TEXT_LEN, SHAPE, AUDIO_LEN, PATCH)
    return (patchify(torch.randn(1, 4, *SHAPE, generator=g), PATCH), torch.randn(1, 2 * AUDIO_LEN, 8, generator=g),
            times.view(1, 2), lay.timestep_indices, lay.token_tags, lay.position_ids.float(),
            torch.randn(1, TEXT_LEN, 32, generator=g), torch.ones(1, TEXT_LEN, dtype=torch.bool), lay.video_indices,
            lay.audio_indices)


def layer_outputs(model: torch.nn.Module, times: torch.Tensor, grad: bool = False) -> tuple[torch.Tensor, ...]:
    """The layers' video and audio outputs of :func:`item` at ``times``."""
    from diffpipe_minimax.layers import split

    x = inputs = item(times)
    with torch.set_grad_enabled(grad):
        for layer in minimax.split_into_layers(model, None):
            x = layer(x)
    return split(x[0], tuple(inputs[0].shape[1:]), tuple(inputs[1].shape[1:]))


def test_the_pruned_file_computes_the_full_model(tiny_minimax: Path, pruned: Path) -> None:
    from diffpipe_core.registry import Registry
    from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
    from diffpipe_minimax.pruned import CurveTimeEmbedding

    cfg = config(tiny_minimax, diffusion_model=pruned)
    assert minimax.validate_model_files(cfg) == []
    line = minimax.model_file_lines(cfg)[0]
    assert f"adaln_curve_grid = {GRID} from the file's tensors (not in the config)" in line, line
    assert "original MiniMax H3" in line, line
    model = minimax.load_diffusion_model(cfg, CPU, torch.float32)
    full = minimax.load_diffusion_model(config(tiny_minimax), CPU, torch.float32)
    assert isinstance(model.time_embedder, CurveTimeEmbedding) and model.time_embedder.table.shape == (GRID, 16)
    assert not [k for k in model.state_dict() if "linear_1" in k or "linear_2" in k]  # no time MLP
    for at_grid in ([13, 40], [0, 64], [64, 31]):  # video and audio times on the table's grid: exact
        times = torch.tensor(at_grid, dtype=torch.float32) / (GRID - 1)
        for got, want in zip(layer_outputs(model, times), layer_outputs(full, times), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # outputs of size 3 (float32 rounding)
    times = torch.tensor([13.5, 40.25]) / (GRID - 1)  # between rows: off by the interpolation's error, small
    for got, want in zip(layer_outputs(model, times), layer_outputs(full, times), strict=True):
        assert 2e-6 < (got - want).abs().max() < 1e-4
    # the layers compute the curve-form model's own diffusers forward (the sampler steps on the same layers)
    times = model_times(torch.tensor([0.3]), torch.tensor([0.7]))[0]
    video, audio, *_, text, _, _, _ = item(times)
    want = forward(model, video, audio, text, times, TEXT_LEN, SHAPE, AUDIO_LEN)
    for got, expected in zip(layer_outputs(model, times), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    registry = Registry()
    assert registry.register_model("minimax-h3", minimax).ok
    assert_stages_read_their_own(registry.model("minimax-h3"), cfg)


def test_the_int8_convrot_pruned_file_stays_quantized_with_lora_on_top(tiny_minimax: Path, tmp_path: Path) -> None:
    from diffpipe_core.adapters import apply_adapter, lora_config
    from diffpipe_core.quantize import ScaledLinear
    from diffpipe_core.registry import Registry
    from diffpipe_core.testing.stage_reads import assert_stages_read_their_own

    file = pruned_file(tiny_minimax, tmp_path / "minimax_h3_fl2va_pruned_int8_convrot.safetensors", GRID,
                       form="int8_convrot")
    cfg = config(tiny_minimax, diffusion_model=file, dtype="bfloat16")
    assert minimax.validate_model_files(cfg) == []
    model = minimax.load_diffusion_model(cfg, CPU, torch.bfloat16)
    kept = {n for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    suffixes = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
    assert kept == {f"transformer_blocks.{i}.{s}" for i in range(2) for s in suffixes}, sorted(kept)
    assert len(PRUNED_QUANTIZED) == 4 and all(model.get_submodule(n).weight.dtype == torch.int8 for n in kept)
    assert model.transformer_blocks[0].adaln_proj.linear.weight.dtype == torch.float32  # as ComfyUI keeps them
    assert f"{len(kept)} linears kept quantized" in minimax.model_file_lines(cfg)[0]
    registry = Registry()
    assert registry.register_model("minimax-h3", minimax).ok
    assert_stages_read_their_own(registry.model("minimax-h3"), cfg)
    plain = minimax.load_diffusion_model(config(tiny_minimax, diffusion_model=pruned_file(
        tiny_minimax, tmp_path / "plain.safetensors", GRID)), CPU, torch.bfloat16)
    times = torch.tensor([0.25, 0.5])
    for got, want in zip(layer_outputs(model, times), layer_outputs(plain, times), strict=True):
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.1)  # int8 rounding of the blocks' linears
    apply_adapter(model, lora_config(2, 2.0, 0.0, minimax.lora_targets(cfg)), torch.float32)
    lora = [p for n, p in model.named_parameters() if "lora_B" in n]
    with torch.no_grad():
        for p in lora:
            p.normal_(std=0.1)
    video, audio = layer_outputs(model, times, grad=True)
    assert not torch.equal(video, layer_outputs(plain, times)[0])
    loss = video.float().square().mean() + audio.float().square().mean()
    inputs_grad = torch.autograd.grad(loss, lora, allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in inputs_grad)
