"""ComfyUI's NVFP4 files (issue 40; ``comfy_quant`` ``{"format": "nvfp4"}``, as ``gemma_3_12B_it_fp4_mixed``): packed
E2M1 weights, float8 block scales in cuBLAS's blocked order and a per-tensor scale, read by the core for every plugin.
The writer (:func:`~diffpipe_core.testing.component_files.nvfp4_quantize`) quantizes as comfy-kitchen does and lays
the scales out from the cuBLAS formula; the reader's weights equal the writer's own dequantization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from diffpipe_core.component_files import (
    describe_diffusion_model,
    fill_whole,
    fit_file,
    load_into,
    model_shapes,
    read_component_file,
)
from diffpipe_core.quantized_files import QuantizationError, unblock_scales
from diffpipe_core.testing.component_files import nvfp4_quantize, quantize_state, save, swizzle_scales


class Tiny(nn.Module):
    """Linears spanning two 128-row and two 4-scale tiles (``wide``), padded to 16s (``narrow``: 24 outputs,
    ``odd``: 20 inputs) and one a "mixed" file keeps in bf16 (``kept``)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(80, 144)
        self.narrow = nn.Linear(144, 24)
        self.odd = nn.Linear(20, 16)
        self.kept = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(24)


QUANTIZED = ("wide", "narrow", "odd")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in Tiny().state_dict().items()}
    state["kept.weight"] = state["kept.weight"].to(torch.bfloat16)
    path = save(quantize_state(state, "nvfp4", keep=("kept.",)), tmp_path_factory.mktemp("nvfp4") / "tiny.st")
    return path, state


def test_the_block_scales_unswizzle_across_tiles() -> None:
    """Scales of 200 rows x 9 blocks (2 x 3 tiles of 128 x 4) come back in place from the cuBLAS layout; read
    without unswizzling they would not."""
    scales = torch.arange(200 * 9, dtype=torch.float32).reshape(200, 9)
    blocked = swizzle_scales(scales)
    assert blocked.shape == (256, 12)
    assert torch.equal(unblock_scales(blocked, 200, 9), scales)
    assert not torch.equal(blocked[:200, :9], scales)


def test_an_nvfp4_file_loads_the_writers_dequantized_weights(written: tuple[Path, dict]) -> None:
    path, state = written
    file = read_component_file(path, "text_encoders")
    assert {m: q.format for m, q in file.quantized.items()} == dict.fromkeys(QUANTIZED, "nvfp4")
    assert file.tensors["narrow.weight"][1] == (32, 144)  # stored padded to 16s, read as the weight's shape
    assert "nvfp4 x3" in file.quantization()
    with torch.device("meta"):
        skeleton = Tiny()
    fit = fit_file(file, model_shapes(skeleton))
    assert fit is not None and fit.complete
    loaded = load_into(skeleton, file, fit, "text_encoders").state_dict()
    for name in QUANTIZED:
        w = state[f"{name}.weight"]
        expected = nvfp4_quantize(w)[3]
        assert torch.equal(loaded[f"{name}.weight"], expected), name
        blocks = nn.functional.pad(w, (0, -w.shape[1] % 16)).reshape(w.shape[0], -1, 16)
        step = (blocks.abs().amax(-1, keepdim=True) / 6 * 1.07).expand_as(blocks).reshape(w.shape[0], -1)
        assert ((loaded[f"{name}.weight"] - w).abs() <= step[:, : w.shape[1]] + 1e-6).all(), name  # NVFP4's error
    assert torch.equal(loaded["kept.weight"], state["kept.weight"].float())
    assert all(torch.equal(loaded[k], state[k]) for k in state if not k.endswith("weight") or k.startswith("norm"))


def test_an_nvfp4_diffusion_model_is_dequantized_as_it_loads(written: tuple[Path, dict]) -> None:
    """A ``diffusion_model`` file in NVFP4 keeps no linear quantized (no ScaledLinear holds packed FP4): its
    per-stage key map dequantizes each weight, cut back to the model's shape."""
    path, state = written
    with torch.device("meta"):
        skeleton = Tiny()
    described = describe_diffusion_model(path, skeleton, ())
    assert described.plan == {}
    model = fill_whole(skeleton, path, described.key_map, torch.device("cpu"))
    for name in QUANTIZED:
        assert torch.equal(model.state_dict()[f"{name}.weight"], nvfp4_quantize(state[f"{name}.weight"])[3]), name


def test_a_truncated_nvfp4_layer_is_named(written: tuple[Path, dict], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(written[0]))
    state["wide.weight_scale"] = state["wide.weight_scale"][:128]
    with pytest.raises(QuantizationError, match=r"bad.st: nvfp4 layer 'wide': weight_scale is .*\(256, 8\)"):
        read_component_file(save(state, tmp_path / "bad.st"), "text_encoders")
