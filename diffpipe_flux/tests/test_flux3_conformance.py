"""FLUX.3 and its step-distilled entry point pass the core's conformance kit (an image batch with masks, at a size in
multiples of 16 pixels); a full fine-tune exports as a diffusers ``transformer`` folder and as one BFL-layout file,
both loading back to the fine-tuned weights (the reference-image mode's, which text-to-image training never runs,
included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_flux.config import Flux3Config
from diffpipe_flux.flux3 import flux3, flux3_distilled


@pytest.mark.parametrize("name", ["flux3", "flux3-distilled"])
def test_flux3_plugins_conform(name: str, request: pytest.FixtureRequest) -> None:
    distilled = name.endswith("distilled")
    path = request.getfixturevalue("tiny_flux3_distilled" if distilled else "tiny_flux3")
    table = {"type": name, "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 90}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(flux3_distilled if distilled else flux3, name, table, pixels=pixels,
                       captions=["a red cat", " ".join(["a photo of a dog"] * 20)])


def test_full_model_exports_load_back(tiny_flux3: Path, tmp_path: Path) -> None:
    from diffusers import Flux3Transformer2DModel

    cfg = validate(Flux3Config, {"type": "flux3", "path": tiny_flux3, "dtype": "float32"}, "test")
    model = flux3.load_diffusion_model(model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        model.norm_out.linear.weight.add_(1.0)  # "fine-tuned": BFL's swapped adaLN halves must come back
        model.single_transformer_blocks[1].attn.norm_q.weight.add_(1.0)
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(flux3, model, cfg, saved)
    single = saved / "single_file" / flux3.single_file_name
    assert "final_layer.image.adaLN_modulation.1.weight" in load_file(str(single))
    from_single = flux3.load_diffusion_model(
        model_config=validate(Flux3Config, {"type": "flux3", "path": tiny_flux3, "dtype": "float32",
                                            "diffusion_model": single}, "test"),
        device=torch.device("cpu"), dtype=torch.float32,
    ).state_dict()
    from_folder = Flux3Transformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    assert "mode_blocks.image_cond.0.attn.to_q.weight" in state
    for key, value in state.items():
        assert torch.equal(from_single[key], value) and torch.equal(from_folder[key], value), key
