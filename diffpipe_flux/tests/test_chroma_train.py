"""Chroma end-to-end through the real CLI (DeepSpeed on gloo, the real cache, peft), on the shared 1-process run
(conftest.py ``chroma_run``, from Chroma's original single file): the loss falls and every default LoRA target
trained; the saved diffusers LoRA loads through ``ChromaPipeline.load_lora_weights`` and reproduces the trained
transformer; the ComfyUI file has the keys ComfyUI's key map takes for Chroma (``diffusion_model.`` + the original
module names, fused q/k/v and ``linear1``, with ``.alpha``) and applies to the original weights like the separate
LoRAs; the run's first sample is ``ChromaPipeline``'s for the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_flux.chroma_keys import layout_for_config as chroma_layout_for_config
from diffpipe_flux.packing import image_ids, text_ids
from diffpipe_flux.testing import bfl_path, comfy_lora_keys, write_tiny_chroma

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 16
CHROMA_TABLE = chroma_layout_for_config({"num_layers": 2, "num_single_layers": 2, "approximator_layers": 2,
                                         "num_attention_heads": 2, "attention_head_dim": 16})  # fmt: skip
MODEL = {"type": "chroma", "diffusion_model": "model.bfl.safetensors", "t5_max_length": 8}
SAMPLE = {"prompts": ["a red cat"], "before_first_step": True, "every_n_steps": STEPS, "steps": 2, "seed": 5}


def run_config(steps: int = STEPS, single_file: bool = True, sample: bool = True, **top: object) -> str:
    """The project's run config: ``steps`` steps from the BFL single file (or the diffusers folder), sampling before
    the first step and at the end (or not at all)."""
    model = {**MODEL, "timestep_sample_method": "uniform"}
    if not single_file:
        del model["diffusion_model"]
    top = {"max_steps": steps, "gradient_accumulation_steps": 2, "checkpoint_every_n_steps": steps, "seed": 7, **top}
    return runs.lora_run_toml(model, 3e-2, {**SAMPLE, "resolution": 32} if sample else None, RANK, ALPHA, **top)
CAPTIONS = ["a red cat", "a blue dog", "a green tree", "a small house", "a dark river", "a bright sky"]


def make_project(root: Path) -> Path:
    write_tiny_chroma(root / "model")
    write_image_dataset(root / "images", 6, size=(32, 32), captions=CAPTIONS)
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[32])
    (root / "run.toml").write_text(run_config())
    return root / "run.toml"


def model_dir(run: Path) -> Path:
    return run.parent.parent / "model"


def test_loss_falls_and_every_target_trained(chroma_run: Path) -> None:
    runs.assert_loss_falls(chroma_run, STEPS, 4)
    params = runs.checkpoint_params(chroma_run)
    ups = {k: v for k, v in params.items() if ".lora_B." in k}
    assert len(ups) == 2 * 12 + 2 * 5  # 12 linears per double block, 5 per single block (2 + 2 blocks)
    assert all(v.abs().max() > 0 for v in ups.values()), [k for k, v in ups.items() if not v.abs().max() > 0]


def transformer_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 8 + 4)
    mask[0, 5:8] = 0
    return {
        "hidden_states": torch.randn(2, 4, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "timestep": torch.rand(2, generator=g),
        "img_ids": image_ids(4, 4).float(),
        "txt_ids": text_ids(8).float(),
        "attention_mask": mask,
    }


def test_diffusers_lora_loads_in_chroma_pipeline_and_reproduces(chroma_run: Path) -> None:
    from diffusers import ChromaPipeline, ChromaTransformer2DModel

    saved = chroma_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    assert "transformer.single_transformer_blocks.1.proj_out.lora_B.weight" in state
    assert not any(k.startswith(("transformer.proj_out", "transformer.distilled")) for k in state)
    folder, targets = model_dir(chroma_run), cfg["target_modules"]
    reference = runs.trained_transformer(ChromaTransformer2DModel, chroma_run, folder, RANK, ALPHA, targets, ())

    pipe = ChromaPipeline.from_pretrained(str(model_dir(chroma_run)), local_files_only=True)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs())


def test_comfyui_lora_keys_and_fused_weights(chroma_run: Path) -> None:
    comfy = load_file(str(chroma_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    assert set(comfy) == comfy_lora_keys(2, 2)
    assert float(comfy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"]) == 3 * RANK
    assert comfy["diffusion_model.single_blocks.0.linear1.lora_B.weight"].shape == (7 * 32, 4 * RANK)

    # applied to the original weights as ComfyUI does, it equals the trained LoRAs merged one by one
    base = load_file(str(bfl_path(model_dir(chroma_run))))
    original = load_file(str(model_dir(chroma_run) / "transformer" / "diffusion_pytorch_model.safetensors"))
    merged = runs.merge_peft(original, runs.checkpoint_params(chroma_run), ALPHA / RANK)
    runs.assert_state_close(CHROMA_TABLE.to_model(runs.apply_comfyui(base, comfy), "applied"), merged)


def test_comfyui_loads_the_diffusers_file_at_the_trained_strength(chroma_run: Path) -> None:
    """ComfyUI's Chroma is a Flux: it loads the diffusers-format file through Flux's ``transformer.<diffusers name>``
    key map, with no ``.alpha`` (scale 1), into the original layout's fused weights."""
    from test_flux_lokr import comfy_flux_key_map

    from diffpipe_core.testing.comfy import apply_file, assert_applies_as_trained

    base = load_file(str(bfl_path(model_dir(chroma_run))))
    lora = load_file(str(chroma_run / "saved" / "final" / "adapter_model.safetensors"))
    original = load_file(str(model_dir(chroma_run) / "transformer" / "diffusion_pytorch_model.safetensors"))
    trained = runs.merge_peft(original, runs.checkpoint_params(chroma_run), ALPHA / RANK)
    applied = CHROMA_TABLE.to_model(apply_file(base, lora, comfy_flux_key_map(2, 2, 32)), "applied")
    assert_applies_as_trained(applied, trained, original)


def test_first_sample_is_chroma_pipelines(chroma_run: Path) -> None:
    from test_chroma_sampling import PROMPT, chromapipeline_latents, encoded

    folders = sorted(p.name for p in (chroma_run / "samples").iterdir())
    assert folders == ["step-0000000", f"step-{STEPS:07d}"]
    first, last = (load_file(str(chroma_run / "samples" / f / "latents.safetensors"))["sample_00"] for f in folders)
    texts = encoded(model_dir(chroma_run), PROMPT, None)
    expected = chromapipeline_latents(model_dir(chroma_run), texts, 1.0, size=32, steps=2)
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-5)
    assert (first - last).abs().max() > 1e-3  # the LoRA trained between them
