"""Flux from the files ComfyUI users keep (issue 35): the transformer, VAE and text encoders as single files in
ComfyUI's layout (BFL names under ``model.diffusion_model.``, the LDM VAE, CLIP under a text-encoder prefix), beside
a folder of only configs and tokenizers (or the Hugging Face cache's snapshot of them); ComfyUI's quantized
transformer files (fp8 scaled, both formats, plain fp8, int8) kept quantized with LoRA on top; bad files named in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.anchor.keys import toml_key, toml_value
from diffpipe_core.component_files import cached_snapshot
from diffpipe_core.parts.ldm import vae_table
from diffpipe_core.quantize import GGUFLinear, ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.testing import runs
from diffpipe_core.testing.component_files import (
    assert_variant_loads_as_itself,
    config_only,
    dequantized_state,
    gguf_values,
    hub_snapshot,
    quantize_file,
    save,
    variant_file,
    variant_model,
    write_component_files,
    write_gguf,
)
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.bfl import layout_for_config
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.plugin import plugin as flux
from diffpipe_flux.testing import transformer_inputs

CPU = torch.device("cpu")
FORMS = ("fp8_scaled", "comfy_quant_fp8", "fp8", "int8", "int8_convrot", "gguf_Q8_0", "gguf_Q4_0")
CLIP_PREFIX = "text_encoders.clip_l.transformer."  # a prefix of ComfyUI's, which diffpipe reads from the keys


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI component files under ``out`` and a config-only folder ``out/configs``."""
    config = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    files = write_component_files(
        folder, out, layout_for_config(config), vae_table(vae, ""), {"text_encoder": CLIP_PREFIX}
    )
    files["configs"] = config_only(folder, out / "configs")
    return files


@pytest.fixture(scope="module")
def comfy(tiny_flux: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_flux, tmp_path_factory.mktemp("comfy"))


def from_files(comfy: dict, **keys) -> FluxConfig:
    """The files in the order a user might list them (T5 first): which encoder each holds is read from its tensors."""
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"]}
    given["text_encoders"] = comfy["text_encoders"][::-1]
    return FluxConfig(type="flux", path=comfy["configs"], **{**given, **keys})


def same_state(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_component_files_load_exactly_the_folders_weights(tiny_flux: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    assert flux.validate_model_files(cfg) == []
    lines = "\n".join(flux.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "BFL layout" in lines
    assert "vae: " in lines and "LDM layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers (under {CLIP_PREFIX.rstrip('.')!r})" in lines
    assert "(T5EncoderModel)" in lines
    folder = FluxConfig(type="flux", path=tiny_flux, encoder_dtype="bfloat16")
    got, expected = flux.load_encoders(cfg, CPU), flux.load_encoders(folder, CPU)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        same_state(getattr(got, name), getattr(expected, name))
    same_state(
        flux.load_diffusion_model(cfg, CPU, torch.bfloat16), flux.load_diffusion_model(folder, CPU, torch.bfloat16)
    )


def test_diffusers_names_with_a_comfyui_prefix_load_too(tiny_flux: Path, comfy: dict, tmp_path: Path) -> None:
    state = load_file(str(tiny_flux / "transformer" / "diffusion_pytorch_model.safetensors"))
    file = save({f"model.diffusion_model.{k}": v for k, v in state.items()}, tmp_path / "diffusers_names.st")
    cfg = from_files(comfy, diffusion_model=file)
    assert flux.validate_model_files(cfg) == []
    assert "diffusers (under 'model.diffusion_model')" in flux.model_file_lines(cfg)[0]
    expected = flux.load_diffusion_model(from_files(comfy), CPU, torch.float32)
    same_state(flux.load_diffusion_model(cfg, CPU, torch.float32), expected)


def quantized(file: Path, out: Path, form: str) -> Path:
    """``file`` quantized as ``form``: one of ComfyUI's (:func:`quantize_file`) or ``gguf_<type>`` (a GGUF file)."""
    if form.startswith("gguf_"):
        return write_gguf(file, out.with_suffix(".gguf"), form.removeprefix("gguf_"))
    return quantize_file(file, out, form)


def values(file: Path) -> dict:
    """What a quantized file stands for: its stored values times their scales (or dequantized GGUF blocks)."""
    return gguf_values(file) if file.suffix == ".gguf" else dequantized_state(file)


@pytest.mark.parametrize("form", FORMS)
def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path, form: str) -> None:
    file = quantized(comfy["diffusion_model"], tmp_path / f"{form}.safetensors", form)
    cfg = from_files(comfy, diffusion_model=file)
    assert flux.validate_model_files(cfg) == []
    model = flux.load_diffusion_model(cfg, CPU, torch.float32)  # computing in float32: comparable to the reference
    if form.startswith("gguf_"):  # every linear whose rows divide into 32-value blocks (x_embedder's 16 do not)
        kept = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        assert len(kept) == 49 and all(m.weight.dtype == torch.uint8 for m in kept)
        full = sum(m.in_features * m.out_features * 2 for m in kept)  # as bfloat16
        assert sum(m.weight.numel() for m in kept) < (0.55 if form == "gguf_Q8_0" else 0.3) * full
    else:
        kept = [m for m in model.modules() if isinstance(m, ScaledLinear)]
        storage = torch.int8 if form.startswith("int8") else torch.float8_e4m3fn
        assert len(kept) == 50 and all(m.weight.dtype == storage for m in kept)  # q, k and v cut from each fused qkv
        assert sum(m.weight.numel() * m.weight.element_size() for m in kept) == sum(m.weight.numel() for m in kept)
    assert f"{len(kept)} linears kept quantized" in flux.model_file_lines(cfg)[0]
    # what the file stands for, as a float32 BFL file: the quantized model computes exactly with those weights
    plain = save(values(file), tmp_path / "dequantized.safetensors")
    reference = flux.load_diffusion_model(from_files(comfy, diffusion_model=plain), CPU, torch.float32)
    inputs = transformer_inputs()
    got, expected = _forward(model, inputs), _forward(reference, inputs)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    # per-stage loading reads each stage's quantized tensors (and their scales) once, from its own stage only
    registry = Registry()
    assert registry.register_model("flux", flux).ok
    assert_stages_read_their_own(registry.model("flux"), cfg)


def _forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        return model(**cast, return_dict=False)[0].float()


def test_an_fp8_scaled_text_encoder_loads_dequantized(comfy: dict, tmp_path: Path) -> None:
    t5 = quantize_file(comfy["text_encoders"][1], tmp_path / "t5xxl_fp8_e4m3fn_scaled.safetensors", "fp8_scaled")
    cfg = from_files(comfy, text_encoders=(comfy["text_encoders"][0], t5), encoder_dtype="float32")
    encoder = flux.load_encoders(cfg, CPU).text_encoder_2
    values = dequantized_state(t5)
    for name, tensor in encoder.state_dict().items():
        if name in values:
            assert torch.equal(tensor, values[name]), name
    assert "quantized scaled" in "\n".join(flux.model_file_lines(cfg))


def problems(cfg: FluxConfig) -> list[str]:
    return flux.validate_model_files(cfg)


def test_bad_files_are_named_in_one_line_each(comfy: dict, tmp_path: Path) -> None:
    dit = Path(comfy["diffusion_model"])
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(dit.read_bytes()[:-100])
    [problem] = problems(from_files(comfy, diffusion_model=truncated))
    assert str(truncated) in problem and "truncated" in problem
    gguf = tmp_path / "flux1-dev-Q4_K_S.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))  # a damaged GGUF file
    [problem] = problems(from_files(comfy, diffusion_model=gguf))
    assert str(gguf) in problem and "not a readable GGUF file" in problem
    mxfp8 = tmp_path / "mxfp8.safetensors"
    state = load_file(str(quantize_file(dit, tmp_path / "q.st", "comfy_quant_fp8")))
    key = next(k for k in state if k.endswith(".comfy_quant"))
    state[key] = torch.tensor(list(b'{"format": "mxfp8"}'), dtype=torch.uint8)
    save(state, mxfp8)
    [problem] = problems(from_files(comfy, diffusion_model=mxfp8))
    assert str(mxfp8) in problem and "'mxfp8'" in problem and "float8_e4m3fn" in problem
    # the VAE given as a text encoder: named with the model's text encoders
    [problem] = problems(from_files(comfy, text_encoders=(comfy["vae"],)))
    assert "text_encoders[0]" in problem and str(comfy["vae"]) in problem and "T5EncoderModel" in problem
    # a text encoder given as the VAE
    [problem] = problems(from_files(comfy, vae=comfy["text_encoders"][1]))
    assert "model.vae" in problem and str(comfy["text_encoders"][1]) in problem
    # a transformer file that lacks a tensor the model needs (its block counts are read from the file itself)
    state = {k: v for k, v in load_file(str(dit)).items() if not k.endswith("txt_in.weight")}
    smaller = save(state, tmp_path / "smaller.safetensors")
    [problem] = problems(from_files(comfy, diffusion_model=smaller))
    assert str(smaller) in problem and "another size" in problem and "context_embedder.weight" in problem


def test_configs_from_the_hugging_face_cache(tiny_flux: Path, comfy: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"no snapshot of black-forest-labs/FLUX\.1-dev.*hf download"):
        cached_snapshot(FluxConfig.hub_repos, "flux")
    snapshot = hub_snapshot(tiny_flux, tmp_path / "hub", "black-forest-labs/FLUX.1-dev")
    cfg = FluxConfig(
        type="flux", diffusion_model=comfy["diffusion_model"], vae=comfy["vae"], text_encoders=comfy["text_encoders"]
    )
    assert cfg.path == snapshot and problems(cfg) == []
    assert "the Hugging Face cache" in flux.model_file_lines(cfg)[0]


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.slow
def test_component_files_train_as_the_folder(flux_two_stages: Path, tmp_path: Path) -> None:
    """The shared 2-stage run of the diffusers folder, again from ComfyUI files: equal losses and LoRA files."""
    from test_flux_train import SAMPLE_TABLE, make_project

    config = make_project(tmp_path, stages=2, single_file=False)
    files = comfy_files(tmp_path / "model", tmp_path / "comfy")
    keys = {
        "path": str(files["configs"]),
        "diffusion_model": str(files["diffusion_model"]),
        "vae": str(files["vae"]),
        "text_encoders": [{"path": str(p), "type": "flux"} for p in files["text_encoders"][::-1]],
    }
    given = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in keys.items())
    config.write_text(config.read_text().replace('path = "model"\n', given) + SAMPLE_TABLE)
    run = runs.train(tmp_path, config, procs=2, timeout=400)
    expected = runs.losses(flux_two_stages)
    assert runs.losses(run) == pytest.approx(expected, rel=1e-6, abs=1e-7)
    for name in ("adapter_model.safetensors", "adapter_model.comfyui.safetensors"):
        got, want = load_file(str(run / "saved/final" / name)), load_file(str(flux_two_stages / "saved/final" / name))
        assert got.keys() == want.keys()
        assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in got), name


@pytest.fixture(scope="module")
def files_project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """test_flux_train's project (1 stage, float32), its model given as ComfyUI files: the root, its run config and
    the files. Every run of the quantized-base tests trains on its one dataset with the same encoder files, so the
    first run caches the dataset and the others read that cache."""
    from test_flux_train import make_project

    root = tmp_path_factory.mktemp("files_project")
    config = make_project(root, stages=1, single_file=False)
    return root, config, comfy_files(root / "model", root / "comfy")


def with_files(config: Path, files: dict, dit: Path, steps: int, out: Path) -> Path:
    """``config`` with the model given as ``files`` (the transformer as ``dit``), trained ``steps`` steps, written
    to ``out`` (beside it: the same dataset and output folder)."""
    keys = {"path": str(files["configs"]), "diffusion_model": str(dit), "vae": str(files["vae"])}
    keys["text_encoders"] = [str(p) for p in files["text_encoders"]]
    given = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in keys.items())
    text = config.read_text().replace('path = "model"\n', given)
    out.write_text(text.replace("max_steps = 24", f"max_steps = {steps}"))
    return out


@pytest.mark.slow
def test_a_lora_trains_on_a_quantized_base(files_project: tuple[Path, Path, dict], tmp_path: Path) -> None:
    """The LoRA trains on the quantized base kept quantized; in float32 the losses equal those of a run on the
    dequantized weights (stored * scale) within 1e-5: the kept weights are exactly what the file stands for. The
    trainer's path is the same for every kept form (``ScaledLinear``, ``GGUFLinear``): int8 and GGUF bases give the
    LoRA the same outputs and gradients as their weights in
    :func:`test_adapters_train_on_a_quantized_base_as_on_its_weights`."""
    root, config, files = files_project
    form = "fp8_scaled"
    quantized_file = quantized(files["diffusion_model"], tmp_path / "q.st", form)
    run = runs.train(root, with_files(config, files, quantized_file, 4, root / f"{form}.toml"), procs=1, timeout=300)
    dequantized = save(values(quantized_file), tmp_path / "dequantized.safetensors")
    plain_config = with_files(config, files, dequantized, 4, root / f"{form}_dequantized.toml")
    plain = runs.train(root, plain_config, procs=1, timeout=300)
    got, expected = runs.losses(run), runs.losses(plain)
    assert len(got) == 4 and got == pytest.approx(expected, rel=1e-5), (got, expected)
    lora = load_file(str(run / "saved/final/adapter_model.safetensors"))
    assert lora and all(torch.isfinite(v).all() for v in lora.values())
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())  # B starts at 0: trained


def test_a_full_finetune_of_a_quantized_file_is_refused(comfy: dict, tmp_path: Path) -> None:
    from diffpipe_core.config import ConfigError, load_config
    from diffpipe_core.registry import get_registry
    from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset

    write_image_dataset(tmp_path / "images", 2, size=(64, 64), captions=["a", "b"])
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "images", resolutions=[64])
    fp8 = quantize_file(comfy["diffusion_model"], tmp_path / "fp8_scaled.safetensors", "fp8_scaled")
    model = {"type": "flux", "path": str(comfy["configs"]), "diffusion_model": str(fp8)}
    config = tmp_path / "run.toml"
    config.write_text(runs.run_toml(model, {"lr": 1e-5}))
    with pytest.raises(ConfigError) as caught:
        load_config(config, get_registry())
    [problem] = [p for p in caught.value.problems if "diffusion_model" in p]
    assert str(fp8) in problem and "full fine-tune" in problem and "[adapter]" in problem
    config.write_text(runs.run_toml(model, {"lr": 1e-5}, {"rank": 4}))
    assert load_config(config, get_registry()).model.diffusion_model == fp8


def test_another_models_file_is_named_with_the_type_to_train_it(comfy: dict, tmp_path: Path) -> None:
    """A Z-Image checkpoint given to flux: named as Z-Image's, with the type that trains it."""
    from diffpipe_zimage.testing import original_path, write_tiny_zimage

    file = original_path(write_tiny_zimage(tmp_path / "zimage"))
    [problem] = problems(from_files(comfy, diffusion_model=file))
    assert str(file) in problem and "a 'z-image' checkpoint" in problem
    assert 'type = "z-image"' in problem


@pytest.mark.parametrize("kind, form", [("lokr", "fp8_scaled"), ("loha", "fp8_scaled"), ("lora", "int8"),
                                        ("lora", "gguf_Q4_0")])  # fmt: skip
def test_adapters_train_on_a_quantized_base_as_on_its_weights(
    comfy: dict, tmp_path: Path, kind: str, form: str
) -> None:
    """peft's LoKr / LoHa on the kept fp8 linears, LoRA on kept int8 and GGUF ones: the same adapter gives the output
    and the input and adapter gradients it gives on the dequantized weights (its delta is computed apart from the
    stored weight, never cast to the storage dtype)."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model

    file = quantized(comfy["diffusion_model"], tmp_path / f"{form}.safetensors", form)
    plain = save(values(file), tmp_path / "dequantized.safetensors")
    models = []
    for dit in (file, plain):
        model = flux.load_diffusion_model(from_files(comfy, diffusion_model=dit), CPU, torch.float32)
        targets = ["attn.to_q", "attn.to_k", "attn.to_v"]
        if kind == "lora":
            config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        else:
            config = (LoKrConfig if kind == "lokr" else LoHaConfig)(
                r=4, alpha=8, target_modules=targets, init_weights=False
            )
        models.append(inject_adapter_in_model(config, model))
    quantized_model, reference = models
    adapter = {n: p for n, p in quantized_model.named_parameters() if p.requires_grad}
    kept = GGUFLinear if form.startswith("gguf_") else ScaledLinear
    assert adapter and any(isinstance(m, kept) for m in quantized_model.modules())
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in adapter:
                param.copy_(adapter[name])
    inputs = transformer_inputs()
    outs, grads = [], []
    for model in models:
        hidden = inputs["hidden_states"].clone().requires_grad_(True)
        out = model(**{**inputs, "hidden_states": hidden}, return_dict=False)[0]
        out.pow(2).mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad} | {"input": hidden.grad})
    assert torch.allclose(outs[0], outs[1], atol=1e-5), (outs[0] - outs[1]).abs().max()
    for name, grad in grads[1].items():
        assert torch.allclose(grads[0][name], grad, atol=1e-5, rtol=1e-4), name


def test_the_files_own_variant_and_sizes_are_read_from_its_tensors(comfy: dict, tmp_path: Path) -> None:
    """A schnell-like file with other block counts and heads beside the dev folder's configs: the model is built as
    the file is (no guidance embedder, its block counts and width), validate says so, and it loads exactly."""
    read = {"num_layers": 1, "num_single_layers": 3, "num_attention_heads": 3, "guidance_embeds": False}
    variant = variant_model(flux, comfy["configs"], **read)
    file = variant_file(flux, variant, tmp_path / "schnell.st")
    assert_variant_loads_as_itself(flux, from_files(comfy, diffusion_model=file), variant, read)


def test_a_diffusers_export_of_another_variant_writes_its_own_config(comfy: dict, tmp_path: Path) -> None:
    """A full fine-tune of a schnell-like file beside the dev folder exports a diffusers folder whose config.json is
    the model's (the file's block counts, no guidance embedder), not the folder's: it loads back as the model."""
    from diffusers import FluxTransformer2DModel

    variant = variant_model(flux, comfy["configs"], num_layers=1, num_single_layers=3, guidance_embeds=False)
    cfg = from_files(comfy, diffusion_model=variant_file(flux, variant, tmp_path / "schnell.st"))
    state = {k: v.contiguous() for k, v in flux.load_diffusion_model(cfg, CPU, torch.float32).state_dict().items()}
    saved = runs.write_saved_model(state, tmp_path / "saved")
    assert flux.export_model(saved_dir=saved, model_config=cfg, out_dir=tmp_path / "out", format="diffusers")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["num_layers"], config["num_single_layers"], config["guidance_embeds"]) == (1, 3, False)
    assert config["_class_name"] == "FluxTransformer2DModel"
    same_state(FluxTransformer2DModel.from_pretrained(str(tmp_path / "out")), variant)


def test_a_files_config_metadata_is_read_below_its_tensors(comfy: dict, tmp_path: Path) -> None:
    """A file carrying its diffusers config as ``config`` metadata (as Lightricks' files do): values no tensor shows
    (the RoPE axes) come from it, and the tensors win where both say (its num_layers is wrong)."""
    from safetensors.torch import load_file

    meta = {"transformer": {"_class_name": "FluxTransformer2DModel", "axes_dims_rope": [2, 6, 8], "num_layers": 7}}
    file = save(load_file(str(comfy["diffusion_model"])), tmp_path / "meta.st", {"config": json.dumps(meta)})
    cfg = from_files(comfy, diffusion_model=file)
    assert flux.validate_model_files(cfg) == []
    line = flux.model_file_lines(cfg)[0]
    assert "axes_dims_rope = [2, 6, 8] from the file's metadata (the config says [4, 4, 8])" in line
    assert "num_layers" not in line
    model = flux.load_diffusion_model(cfg, CPU, torch.float32)
    assert list(model.config.axes_dims_rope) == [2, 6, 8] and model.config.num_layers == 2
