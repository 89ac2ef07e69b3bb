"""ERNIE-Image from the files ComfyUI users keep: ``ernie-image.safetensors`` (the transformer in diffusers' names under
``model.diffusion_model.``), ``flux2-vae.safetensors`` (FLUX.2's VAE in BFL's layout, no batch-norm step count) and
``ministral-3-3b.safetensors`` (the Ministral 3 language model under ``model.``, no vision tower), beside a folder of
only configs and tokenizers: the weights load exactly as the folder's, and a file of another size loads as itself
(sizes read from its tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffpipe_core.parts.flux2_vae import vae_layout
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_variant_loads_as_itself,
    component_state,
    config_only,
    quantize_file,
    save,
    variant_file,
    variant_model,
)
from diffpipe_ernie.plugin import TEXT_OPTIONAL
from diffpipe_ernie.plugin import plugin as ernie
from diffpipe_ernie.testing import COMFY_PREFIX, tiny_config

CPU = torch.device("cpu")


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI's ERNIE-Image files under ``out`` and a config-only folder ``out/configs``."""
    table = vae_layout(json.loads((folder / "vae" / "config.json").read_text()))
    vae = table.to_original(component_state(folder, "vae"))
    lm = "language_model."
    text = {"model." + k[len(lm):]: v for k, v in component_state(folder, "text_encoder").items() if k.startswith(lm)}
    dit = {COMFY_PREFIX + k: v for k, v in component_state(folder, "transformer").items()}
    return {
        "diffusion_model": save(dit, out / "ernie-image.safetensors"),
        "vae": save({k: v for k, v in vae.items() if k != "bn.num_batches_tracked"}, out / "flux2-vae.safetensors"),
        "text_encoder": save(text, out / "ministral-3-3b.safetensors"),
        "configs": config_only(folder, out / "configs"),
    }


@pytest.fixture(scope="module")
def comfy(tiny_ernie: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_ernie, tmp_path_factory.mktemp("comfy"))


def from_files(comfy: dict, **keys):
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], "text_encoders": [comfy["text_encoder"]]}
    return tiny_config(comfy["configs"], **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_ernie: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    assert ernie.validate_model_files(cfg) == []
    lines = "\n".join(ernie.model_file_lines(cfg))
    assert f"vae: {comfy['vae']}: BFL layout" in lines
    got, expected = ernie.load_encoders(cfg, CPU), ernie.load_encoders(tiny_config(tiny_ernie), CPU)
    for component in ("vae", "text_encoder"):
        a, b = getattr(got, component).state_dict(), getattr(expected, component).state_dict()
        assert a.keys() == b.keys()
        for key in a:
            if component == "text_encoder" and key.startswith(TEXT_OPTIONAL):
                continue  # the vision tower: not in the file, never run
            if key != "bn.num_batches_tracked":
                assert torch.equal(a[key], b[key]), (component, key)
    # what the pipeline reads: the penultimate hidden states, equal
    ours, theirs = got.text.encode_prompt(["a red cat"], CPU), expected.text.encode_prompt(["a red cat"], CPU)
    assert torch.equal(ours[0], theirs[0])
    model = ernie.load_diffusion_model(cfg, CPU, torch.float32).state_dict()
    reference = ernie.load_diffusion_model(tiny_config(tiny_ernie), CPU, torch.float32).state_dict()
    assert model.keys() == reference.keys() and all(torch.equal(model[k], reference[k]) for k in model)


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "ernie-image_fp8_scaled.safetensors", "fp8_scaled")
    assert_kept_quantized(ernie, from_files(comfy, diffusion_model=file), from_files(comfy), torch.float8_e4m3fn)


def test_a_file_of_another_size_loads_as_itself(comfy: dict, tmp_path: Path) -> None:
    """Other block count, width, heads and MLP width than the folder's config: read from the file's tensors."""
    read = {"num_layers": 1, "hidden_size": 48, "num_attention_heads": 3, "ffn_hidden_size": 40}
    variant = variant_model(ernie, comfy["configs"], **read)
    file = variant_file(ernie, variant, tmp_path / "ernie-image.safetensors")
    assert_variant_loads_as_itself(ernie, from_files(comfy, diffusion_model=file), variant, read)
