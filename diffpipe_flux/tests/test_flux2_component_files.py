"""FLUX.2 [dev] and [klein] from the files ComfyUI users keep (issue 35): the transformer in BFL names under
``model.diffusion_model.``, ``flux2-vae.safetensors`` (BFL's VAE: the LDM layout with ``encoder.quant_conv``,
``decoder.post_quant_conv`` and the batch norm's statistics, no step count) and the text encoder as ComfyUI ships it,
the language model only under ``model.`` (``mistral_3_small_flux2_bf16.safetensors`` with its ``tekken_model``
tokenizer tensor, ``qwen_3_4b.safetensors``: no LM head, no vision tower), beside a folder of only configs and
tokenizers (or the Hugging Face cache's snapshot); an fp8 scaled transformer kept quantized; a [klein] run from the
files trains as the folder's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.anchor.keys import toml_key, toml_value
from diffpipe_core.component_files import tied_names
from diffpipe_core.parts.flux2_vae import vae_layout
from diffpipe_core.quantize import ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.testing import runs
from diffpipe_core.testing.component_files import (
    COMFY_PREFIX,
    assert_variant_loads_as_itself,
    component_state,
    config_only,
    hub_snapshot,
    quantize_file,
    save,
    variant_file,
    variant_model,
)
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.config import Flux2Config, Flux2KleinConfig
from diffpipe_flux.flux2 import MISTRAL_VISION
from diffpipe_flux.flux2 import flux2 as dev_plugin
from diffpipe_flux.flux2 import klein as klein_plugin
from diffpipe_flux.flux2_keys import layout_for_config

CPU = torch.device("cpu")
#: entry point -> (plugin, config class, tiny folder fixture, ComfyUI's file names for the text encoder and transformer)
VARIANTS = {
    "flux2": (dev_plugin, Flux2Config, "tiny_flux2", "mistral_3_small_flux2_bf16", "flux2_dev"),
    "flux2-klein": (klein_plugin, Flux2KleinConfig, "tiny_klein", "qwen_3_4b", "flux-2-klein-4b"),
}


def comfy_text_encoder(state: dict[str, torch.Tensor], dev: bool) -> dict[str, torch.Tensor]:
    """A transformers text encoder's state as ComfyUI's file holds it: the language model under ``model.``, no LM head
    (nor Mistral 3's vision tower and projector); ComfyUI's Mistral file also carries its tokenizer as a tensor."""
    if not dev:
        return {k: v for k, v in state.items() if not k.startswith("lm_head.")}
    lm = ("language_model.model.", "model.language_model.")  # as saved (transformers' older names), as loaded
    out = {"model." + k[len(p) :]: v for k, v in state.items() for p in lm if k.startswith(p)}
    out["tekken_model"] = torch.tensor(list(b'{"config": {}}'), dtype=torch.uint8)
    return out


def comfy_files(folder: Path, out: Path, variant: str) -> dict:
    """``folder`` as ComfyUI's FLUX.2 files under ``out`` and a config-only folder ``out/configs``."""
    _, _, _, text_name, dit_name = VARIANTS[variant]
    config = json.loads((folder / "transformer" / "config.json").read_text())
    vae_config = json.loads((folder / "vae" / "config.json").read_text())
    dit = layout_for_config(config).to_original(component_state(folder, "transformer"))
    vae = vae_layout(vae_config).to_original(component_state(folder, "vae"))
    text = comfy_text_encoder(component_state(folder, "text_encoder"), variant == "flux2")
    return {
        "diffusion_model": save({COMFY_PREFIX + k: v for k, v in dit.items()}, out / f"{dit_name}.safetensors"),
        "vae": save({k: v for k, v in vae.items() if k != "bn.num_batches_tracked"}, out / "flux2-vae.safetensors"),
        "text_encoder": save(text, out / f"{text_name}.safetensors"),
        "configs": config_only(folder, out / "configs"),
    }


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """``(entry point, plugin, config class, tiny folder, its ComfyUI files)``."""
    name = request.param
    plugin, cls, fixture, _, _ = VARIANTS[name]
    folder = request.getfixturevalue(fixture)
    return name, plugin, cls, folder, comfy_files(folder, tmp_path_factory.mktemp(name), name)


def from_files(variant: tuple, **keys):
    name, _, cls, _, files = variant
    given = {"diffusion_model": files["diffusion_model"], "vae": files["vae"]}
    given["text_encoders"] = (files["text_encoder"],)
    return cls(type=name, path=files["configs"], **{**given, **keys})


def test_comfyui_files_load_exactly_the_folders_weights(variant: tuple) -> None:
    name, plugin, cls, folder, files = variant
    cfg = from_files(variant)
    assert plugin.validate_model_files(cfg) == []
    lines = "\n".join(plugin.model_file_lines(cfg))
    assert f"diffusion_model: {files['diffusion_model']}: BFL FLUX.2 layout, float32" in lines
    assert f"vae: {files['vae']}: BFL layout" in lines
    layout = "diffusers (under 'model')" if name == "flux2" else "diffusers,"  # Mistral 3's model.language_model.
    assert f"text_encoder: {files['text_encoder']}: {layout}" in lines
    expected_cfg = cls(type=name, path=folder, encoder_dtype="bfloat16")
    got, expected = plugin.load_encoders(cfg, CPU), plugin.load_encoders(expected_cfg, CPU)
    optional = plugin.folder.file_optional
    for component in ("vae", "text_encoder"):
        a, b = getattr(got, component).state_dict(), getattr(expected, component).state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype, key
            if key.startswith(optional[component]) and tied_names(getattr(got, component)).get(key, key) == key:
                assert not a[key].any(), key  # not in the file, never run: zeros (a tied LM head is the embedding)
            else:
                assert torch.equal(a[key], b[key]), key
    # what the pipelines read: the stacked hidden states, equal; the vision tower is not in the file
    ours, theirs = got.text.encode_prompt(["a red cat"]), expected.text.encode_prompt(["a red cat"])
    assert torch.equal(ours[0], theirs[0])
    if name == "flux2":
        assert all(not k.startswith(MISTRAL_VISION) for k in load_file(str(files["text_encoder"])))
    model = plugin.load_diffusion_model(cfg, CPU, torch.bfloat16).state_dict()
    reference = plugin.load_diffusion_model(expected_cfg, CPU, torch.bfloat16).state_dict()
    assert model.keys() == reference.keys()
    assert all(model[k].dtype == reference[k].dtype and torch.equal(model[k], reference[k]) for k in model)


def test_an_fp8_scaled_transformer_stays_quantized(variant: tuple, tmp_path: Path) -> None:
    name, plugin, *_ = variant
    file = quantize_file(variant[4]["diffusion_model"], tmp_path / "flux2_fp8_scaled.safetensors", "fp8_scaled")
    cfg = from_files(variant, diffusion_model=file)
    assert plugin.validate_model_files(cfg) == []
    stored = load_file(str(file))
    model = plugin.load_diffusion_model(cfg, CPU, torch.bfloat16)
    kept = [m for m in model.modules() if isinstance(m, ScaledLinear)]
    fused_qkv = sum(1 for k, v in stored.items() if k.endswith("qkv.weight") and v.dtype == torch.float8_e4m3fn)
    quantized = sum(1 for v in stored.values() if v.dtype == torch.float8_e4m3fn and v.numel())
    assert len(kept) == quantized + 2 * fused_qkv > 10  # q, k and v cut from each fused qkv
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in kept)
    assert f"{len(kept)} linears kept quantized" in plugin.model_file_lines(cfg)[0]
    registry = Registry()
    assert registry.register_model(name, plugin).ok
    assert_stages_read_their_own(registry.model(name), cfg)


def test_configs_from_the_hugging_face_cache(variant: tuple, tmp_path: Path, monkeypatch) -> None:
    name, plugin, cls, folder, files = variant
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    given = {"diffusion_model": files["diffusion_model"], "vae": files["vae"]}
    given["text_encoders"] = (files["text_encoder"],)
    with pytest.raises(ValueError, match=r"no snapshot of black-forest-labs/FLUX\.2-.*hf download"):
        cls(type=name, **given)
    snapshot = hub_snapshot(folder, tmp_path / "hub", cls.hub_repos[-1])
    cfg = cls(type=name, **given)
    assert cfg.path == snapshot and plugin.validate_model_files(cfg) == []


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stages", "shared"), [("flux2-klein", 1, "klein_run"), ("flux2", 2, "flux2_run")])
def test_component_files_train_as_the_folder(
    name: str, stages: int, shared: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The shared run of each entry point ([klein]: 1 process; [dev]: 2 stages in 2 processes; each from its BFL
    transformer file, the folder's VAE and text encoder), again with the VAE and the text encoder from ComfyUI's files
    beside a config-only folder: equal losses and equal LoRA files."""
    from test_flux2_train import make_project

    expected = request.getfixturevalue(shared)
    config = make_project(tmp_path, name, stages)
    files = comfy_files(tmp_path / "model", tmp_path / "comfy", name)
    keys = {"path": str(files["configs"]), "vae": str(files["vae"])}
    keys["text_encoders"] = [{"path": str(files["text_encoder"]), "type": "flux2"}]
    given = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in keys.items())
    text, found = re.subn(r"^path = ['\"]model['\"]\n", given, config.read_text(), flags=re.M)
    assert found == 1
    config.write_text(text)
    run = runs.train(tmp_path, config, procs=stages, timeout=400)
    assert runs.losses(run) == pytest.approx(runs.losses(expected), rel=1e-6, abs=1e-7)
    for file in ("adapter_model.safetensors", "adapter_model.comfyui.safetensors"):
        got, want = load_file(str(run / "saved/final" / file)), load_file(str(expected / "saved/final" / file))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), file


def test_a_file_of_another_variant_loads_as_itself(variant: tuple, tmp_path: Path) -> None:
    """A klein-like file (no guidance embedder) beside the dev folder, a dev-like one beside klein's, each with other
    block counts and heads: read from the file's tensors."""
    _, plugin, _, _, files = variant
    guidance = plugin.folder.model_config(files["configs"])["guidance_embeds"]
    read = {"num_layers": 1, "num_single_layers": 3, "num_attention_heads": 3, "guidance_embeds": not guidance}
    model = variant_model(plugin, files["configs"], **read)
    file = variant_file(plugin, model, tmp_path / "flux2.safetensors")
    assert_variant_loads_as_itself(plugin, from_files(variant, diffusion_model=file), model, read)
