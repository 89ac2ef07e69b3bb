"""LTX-2 from the files ComfyUI users keep (issue 35): the checkpoint (``ltx-2-19b-dev.safetensors``) holding the
transformer and its text connectors (``model.diffusion_model.*``, ``text_embedding_projection.*``), the video VAE
(``vae.*``), the audio VAE (``audio_vae.*``) and the vocoder, each in the original Lightricks layout, given as
``diffusion_model``, ``vae`` and ``audio_vae``; Gemma 3 as ComfyUI's text encoder file (``gemma_3_12B_it``: the
language model under ``model.``, no vision tower); beside a folder of only configs and tokenizers (or the Hugging
Face cache's snapshot); an fp8 scaled transformer kept quantized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.quantize import ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.testing.component_files import (
    assert_trains_as,
    assert_variant_loads_as_itself,
    component_state,
    dequantized_state,
    hub_snapshot,
    quantize_file,
    quantize_state,
    save,
    train_from_files,
    variant_file,
    variant_model,
)
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_ltx.config import LTX2Config
from diffpipe_ltx.ltx2 import ltx2
from diffpipe_ltx.ltx2_testing import write_comfy_files

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def comfy(tiny_ltx2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_comfy_files(tiny_ltx2, tmp_path_factory.mktemp("comfy"))


def given(comfy: dict) -> dict:
    file = comfy["checkpoint"]
    return {"diffusion_model": file, "vae": file, "audio_vae": file, "text_encoders": [comfy["gemma"]]}


def from_files(comfy: dict, **keys) -> LTX2Config:
    return LTX2Config(type="ltx-2", path=comfy["configs"], max_sequence_length=16, **{**given(comfy), **keys})


def assert_same(got: torch.nn.Module, expected: torch.nn.Module, absent: tuple[str, ...] = ()) -> None:
    """Equal tensors and dtypes; those under ``absent`` (not in the file, never run) are zeros."""
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert not a[key].any() if key.startswith(absent) else torch.equal(a[key], b[key]), key


def test_the_checkpoint_and_gemma_file_load_exactly_the_folders_weights(tiny_ltx2: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    assert ltx2.validate_model_files(cfg) == []
    lines = "\n".join(ltx2.model_file_lines(cfg))
    checkpoint = comfy["checkpoint"]
    assert f"diffusion_model: {checkpoint}: original Lightricks layout, float32" in lines
    for component in ("vae", "audio_vae", "connectors"):
        assert f"{component}: {checkpoint}: original Lightricks layout" in lines, component
    assert f"text_encoder: {comfy['gemma']}: diffusers (under 'model')" in lines
    folder = LTX2Config(type="ltx-2", path=tiny_ltx2, max_sequence_length=16, encoder_dtype="bfloat16")
    got, expected = ltx2.load_encoders(cfg, CPU), ltx2.load_encoders(folder, CPU)
    for name in ("vae", "connectors"):
        assert_same(getattr(got, name), getattr(expected, name))
    assert_same(got.text_encoder, expected.text_encoder, ltx2.folder.file_optional["text_encoder"])
    files = ltx2.folder.component_files(comfy["configs"], cfg)
    audio = ltx2.folder.load(comfy["configs"], "audio_vae", torch.bfloat16, CPU, files["audio_vae"])
    assert_same(audio, ltx2.folder.load(tiny_ltx2, "audio_vae", torch.bfloat16, CPU))
    captions = ["a red car moving slowly"]
    ours, theirs = ltx2.encode_batch(got, _captions(captions)), ltx2.encode_batch(expected, _captions(captions))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    model = ltx2.load_diffusion_model(cfg, CPU, torch.bfloat16)
    assert_same(model, ltx2.load_diffusion_model(folder, CPU, torch.bfloat16))


def _captions(captions: list[str]):
    from diffpipe_core.types import EncodeBatch

    return EncodeBatch(captions=captions)


def test_ltx23_from_the_anchors_files_loads_exactly_the_folders_weights(tiny_ltx23: Path, tmp_path: Path) -> None:
    """LTX-2.3 as diffusion-pipe trains it (its docs' ``ltx-2.3-22b-dev.safetensors`` and a Gemma 3 file): the
    checkpoint gives the transformer, the connectors' per-stream projections, the VAE and the audio VAE, the Gemma
    file the text encoder, each loaded equal to the LTX-2.3 folder's."""
    from diffpipe_ltx.config import LTX23Config
    from diffpipe_ltx.ltx23 import ltx23

    files = write_comfy_files(tiny_ltx23, tmp_path, "ltx-2.3-22b-dev.safetensors")
    cfg = LTX23Config(type="ltx-2.3", path=files["configs"], max_sequence_length=16, **given(files))
    assert ltx23.validate_model_files(cfg) == []
    lines = "\n".join(ltx23.model_file_lines(cfg))
    for component in ("diffusion_model", "vae", "audio_vae", "connectors"):
        assert f"{component}: {files['checkpoint']}: original Lightricks layout" in lines, component
    folder = LTX23Config(type="ltx-2.3", path=tiny_ltx23, max_sequence_length=16, encoder_dtype="bfloat16")
    got, expected = ltx23.load_encoders(cfg, CPU), ltx23.load_encoders(folder, CPU)
    for name in ("vae", "connectors"):
        assert_same(getattr(got, name), getattr(expected, name))
    assert_same(got.text_encoder, expected.text_encoder, ltx23.folder.file_optional["text_encoder"])
    audio_file = ltx23.folder.component_files(files["configs"], cfg)["audio_vae"]
    audio = ltx23.folder.load(files["configs"], "audio_vae", torch.bfloat16, CPU, audio_file)
    assert_same(audio, ltx23.folder.load(tiny_ltx23, "audio_vae", torch.bfloat16, CPU))
    assert_same(ltx23.load_diffusion_model(cfg, CPU, torch.bfloat16),
                ltx23.load_diffusion_model(folder, CPU, torch.bfloat16))


def test_ltx23_reads_comfyuis_fp4_mixed_gemma_file(tiny_ltx23: Path, tmp_path: Path) -> None:
    """diffusion-pipe's LTX-2.3 text encoder, ComfyUI's ``gemma_3_12B_it_fp4_mixed.safetensors``: the Gemma file in
    bf16 with its linears in NVFP4 but for some left bf16 ("mixed") loads as ``text_encoders`` to the values the file
    stands for (the same file written dequantized, decoded by the test writer's own cuBLAS-layout formula)."""
    from diffpipe_ltx.config import LTX23Config
    from diffpipe_ltx.ltx23 import ltx23

    files = write_comfy_files(tiny_ltx23, tmp_path, "ltx-2.3-22b-dev.safetensors")
    gemma = {k: v.to(torch.bfloat16) for k, v in load_file(str(files["gemma"])).items()}
    state = quantize_state(gemma, "nvfp4", keep=("o_proj",))
    assert any(k.endswith("weight_scale_2") for k in state)
    assert state["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    fp4 = save(state, tmp_path / "gemma_3_12B_it_fp4_mixed.safetensors")
    values = dequantized_state(fp4)  # NVFP4 weights padded to 16s (the 390-token embedding to 400 rows): cut back
    values = {k: v[tuple(slice(n) for n in gemma[k].shape)] for k, v in values.items()}
    plain = save(values, tmp_path / "gemma_dequantized.safetensors")

    def config(encoder: Path) -> LTX23Config:
        keys = {**given(files), "text_encoders": [encoder]}
        return LTX23Config(type="ltx-2.3", path=files["configs"], max_sequence_length=16, encoder_dtype="float32",
                           **keys)

    cfg = config(fp4)
    assert ltx23.validate_model_files(cfg) == []
    assert "nvfp4 x" in "\n".join(ltx23.model_file_lines(cfg))
    def text_encoder(cfg: LTX23Config) -> torch.nn.Module:
        file = ltx23.folder.component_files(files["configs"], cfg)["text_encoder"]
        return ltx23.folder.load(files["configs"], "text_encoder", torch.float32, CPU, file)

    got = text_encoder(cfg)
    assert_same(got, text_encoder(config(plain)), ltx23.folder.file_optional["text_encoder"])
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    weights = got.state_dict()
    assert name in weights and not torch.equal(weights[name], gemma["model.layers.0.mlp.up_proj.weight"].float())


def test_the_tables_are_diffusers_converters_inverted(tiny_ltx2: Path, comfy: dict) -> None:
    """diffusers' own single-file converters read the checkpoint's VAE and audio VAE back to the folder's names."""
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers, convert_ltx2_vae_to_diffusers

    state = load_file(str(comfy["checkpoint"]))
    for prefix, convert, component in (
        ("vae.", convert_ltx2_vae_to_diffusers, "vae"),
        ("audio_vae.", convert_ltx2_audio_vae_to_diffusers, "audio_vae"),
    ):
        part = {k: v for k, v in state.items() if k.startswith(prefix)}
        expected = component_state(tiny_ltx2, component)
        converted = convert(part)
        assert converted.keys() == expected.keys(), component
        assert all(torch.equal(converted[k], expected[k]) for k in expected), component


def test_an_fp8_scaled_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["checkpoint"], tmp_path / "ltx-2-19b-dev-fp8.safetensors", "fp8_scaled")
    cfg = from_files(comfy, diffusion_model=file)
    assert ltx2.validate_model_files(cfg) == []
    model = ltx2.load_diffusion_model(cfg, CPU, torch.bfloat16)
    kept = [m for m in model.modules() if isinstance(m, ScaledLinear)]
    skipped = ("model.diffusion_model.video_embeddings_connector", "model.diffusion_model.audio_embeddings_connector")
    stored = [
        k
        for k, v in load_file(str(file)).items()
        if k.startswith("model.diffusion_model.") and not k.startswith(skipped) and v.dtype == torch.float8_e4m3fn
    ]
    assert len(kept) == len(stored) > 20 and all(m.weight.dtype == torch.float8_e4m3fn for m in kept)
    assert f"{len(kept)} linears kept quantized" in ltx2.model_file_lines(cfg)[0]
    registry = Registry()
    assert registry.register_model("ltx-2", ltx2).ok
    assert_stages_read_their_own(registry.model("ltx-2"), cfg)


def test_configs_from_the_hugging_face_cache(tiny_ltx2: Path, comfy: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"no snapshot of Lightricks/LTX-2 .*hf download"):
        LTX2Config(type="ltx-2", max_sequence_length=16, **given(comfy))
    snapshot = hub_snapshot(tiny_ltx2, tmp_path / "hub", "Lightricks/LTX-2")
    cfg = LTX2Config(type="ltx-2", max_sequence_length=16, **given(comfy))
    assert cfg.path == snapshot and ltx2.validate_model_files(cfg) == []


def test_a_file_of_another_variant_loads_as_itself(comfy: dict, tmp_path: Path) -> None:
    """Another block count and width than the folder's config: read from the file's tensors."""
    read = {"num_layers": 1, "attention_head_dim": 24, "cross_attention_dim": 48}
    variant = variant_model(ltx2, comfy["configs"], **read)
    file = variant_file(ltx2, variant, tmp_path / "ltx2.safetensors")
    assert_variant_loads_as_itself(ltx2, from_files(comfy, diffusion_model=file), variant, read)


@pytest.mark.slow
def test_component_files_train_as_the_folder(ltx2_run: Path, tmp_path: Path) -> None:
    """The shared run (the diffusers folder), again from ComfyUI's files only (the checkpoint holding the
    transformer, VAE and audio VAE, and the Gemma file): equal losses and LoRA files."""
    from test_ltx2_train import make_project

    config = make_project(tmp_path)
    comfy = write_comfy_files(tmp_path / "model", tmp_path / "comfy")
    keys = {k: [str(p) for p in v] if isinstance(v, list) else str(v) for k, v in given(comfy).items()}
    assert_trains_as(train_from_files(tmp_path, config, {"path": str(comfy["configs"]), **keys}), ltx2_run)
