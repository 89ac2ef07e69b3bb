"""Issue 10, test 5: a BFL single-file Flux loaded per stage. Each of 2 stages reads only its own keys from the
file (counted on the real safetensors reader), splits only its own blocks' fused tensors, and gets exactly the
weights a whole load gives."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from diffpipe_core.registry import get_registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.testing import bfl_path


def test_bfl_single_file_is_read_per_stage(tiny_flux: Path) -> None:
    plugin = get_registry().model("flux")
    table = {"type": "flux", "path": tiny_flux, "dtype": "float32", "diffusion_model": bfl_path(tiny_flux)}
    first, second = (set(s.reads) for s in assert_stages_read_their_own(plugin, validate(FluxConfig, table, "test")))
    with safe_open(str(bfl_path(tiny_flux)), "pt") as f:
        file_keys = set(f.keys())
    # the two stages together read the file exactly once
    assert first | second == file_keys
    print(f"BFL file: {len(file_keys)} keys; stage 0 read {len(first)}, stage 1 read {len(second)}")
    # each stage split only the fused tensors of its own blocks
    fused = {k for k in file_keys if k.endswith(("qkv.weight", "linear1.weight"))}
    assert first & fused and second & fused
    assert all(k.startswith("double_blocks.") for k in first & fused)
    assert any(k.startswith("single_blocks.") for k in second & fused)
