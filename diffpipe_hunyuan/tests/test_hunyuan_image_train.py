"""HunyuanImage-2.1 end to end through the real CLI (DeepSpeed on gloo, the real cache, peft): one shared 1-process
LoRA run (conftest.py) on captions with and without quoted text, from Tencent's single file; the loss falls, the
sample before the first step is ``HunyuanImagePipeline``'s (its guider, the folder's scheduler); 2 pipeline stages
from its cache draw the same losses; the diffusers LoRA loads with ``transformer.load_lora_adapter`` (the pipeline
has no ``load_lora_weights``) and reproduces the trained transformer; the ComfyUI file holds only keys ComfyUI's
generic key map has for its ``HunyuanImage21`` model (its fused names) and applies like the trained LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.comfy import apply_file, generic_key_map
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_hunyuan.original import comfyui_layout
from diffpipe_hunyuan.original21 import layout_for_model_keys
from diffpipe_hunyuan.testing21 import load_pipeline, original_path, write_tiny_hunyuan_image

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, TWO_STAGE_STEPS = 4, 8.0, 16, 4
CAPTIONS = ["a red cat", 'a sign saying "open"', "a green tree", "a small house"]
SAMPLE = {"prompts": ['a cat with the text "hi"'], "negative_prompt": "blurry", "cfg": 3.0, "steps": 3,
          "before_first_step": True, "seed": 5}


def run_config(steps: int, stages: int = 1, sample: dict | None = SAMPLE, **top: object) -> str:
    model = {"type": "hunyuan-image-2.1", "text_max_length": 16, "glyph_max_length": 8,
             "timestep_sample_method": "uniform", "diffusion_model": original_path(Path("model")).name}
    top = {"max_steps": steps, "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3, **top}
    return runs.lora_run_toml(model, 3e-2, sample, RANK, ALPHA, **top)


def train_project(root: Path) -> Path:
    """The tiny model, 4 captioned 32x32 images (one caption with quoted text), LoRA from Tencent's single file,
    a guided sample before the first step; trained in 1 process. Its run folder."""
    write_tiny_hunyuan_image(root / "model")
    write_image_dataset(root / "data", len(CAPTIONS), size=(32, 32), captions=CAPTIONS)
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[32], enable_ar_bucket=False)
    (root / "run.toml").write_text(run_config(STEPS))
    return runs.train(root, "run.toml", 1, OMP_NUM_THREADS="1")


def test_the_loss_falls_and_the_sample_is_the_pipelines(hunyuan_image_run: Path) -> None:
    from diffpipe_core.sampling.loop import noise_generator

    runs.assert_loss_falls(hunyuan_image_run, STEPS, 4)
    folder = hunyuan_image_run / "samples" / "step-0000000"
    got = load_file(str(folder / "latents.safetensors"))["sample_00"]
    pipe = load_pipeline(hunyuan_image_run.parent.parent / "model")
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 16, 8  # the run's text and glyph lengths
    pipe.guider, pipe.ocr_guider = (g.new(guidance_scale=3.0) for g in (pipe.guider, pipe.ocr_guider))
    with torch.no_grad():  # the LoRA's B is 0 before the first step: the base model's sample
        want = pipe(prompt=SAMPLE["prompts"][0], negative_prompt="blurry", num_inference_steps=3, height=32, width=32,
                    latents=torch.randn(1, 8, 8, 8, generator=noise_generator(5, 0)), output_type="latent").images
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def test_trains_on_two_stages_as_on_one(hunyuan_image_run: Path) -> None:
    staged = runs.stages_run(hunyuan_image_run, run_config(TWO_STAGE_STEPS, 2, None, partition_split=[2]))
    runs.assert_stages_train_as_one(staged, hunyuan_image_run, TWO_STAGE_STEPS)


def transformer_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask, glyph_mask = torch.ones(2, 6, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    mask[0, 3:], glyph_mask[1, :2] = 0, 1
    return {"hidden_states": torch.randn(2, 8, 2, 4, generator=g), "timestep": torch.rand(2, generator=g) * 1000,
            "encoder_hidden_states": torch.randn(2, 6, 32, generator=g), "encoder_attention_mask": mask,
            "encoder_hidden_states_2": torch.randn(2, 4, 32, generator=g), "encoder_attention_mask_2": glyph_mask}


def test_diffusers_lora_loads_with_load_lora_adapter_and_reproduces(hunyuan_image_run: Path) -> None:
    from diffusers import HunyuanImagePipeline, HunyuanImageTransformer2DModel

    model_dir, saved = hunyuan_image_run.parent.parent / "model", hunyuan_image_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    blocks = ("transformer.transformer_blocks.", "transformer.single_transformer_blocks.")
    assert all(k.startswith(blocks) for k in state)
    trained = ("transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.norm1_context.linear",
               "single_transformer_blocks.1.proj_out", "single_transformer_blocks.0.norm.linear")
    reference = runs.trained_transformer(
        HunyuanImageTransformer2DModel, hunyuan_image_run, model_dir, RANK, ALPHA, cfg["target_modules"], trained
    )
    pipe = HunyuanImagePipeline.from_pretrained(str(model_dir), local_files_only=True)
    assert not hasattr(pipe, "load_lora_weights")  # why the README points at load_lora_adapter
    untrained = runs.outputs(pipe.transformer, transformer_inputs())
    with runs.library_warnings() as warnings:
        pipe.transformer.load_lora_adapter(
            str(saved), weight_name="adapter_model.safetensors", prefix="transformer", adapter_name="trained"
        )
    assert not [m for m in warnings if "keys" in m.lower()], warnings
    runs.assert_reproduces(runs.outputs(pipe.transformer, transformer_inputs()),
                           runs.outputs(reference, transformer_inputs()), untrained)


def test_comfyui_lora_has_comfyuis_keys_and_applies_like_the_trained_lora(hunyuan_image_run: Path) -> None:
    comfy = load_file(str(hunyuan_image_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].shape == (3 * RANK, 32)
    assert float(comfy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"]) == 3 * RANK
    assert comfy["diffusion_model.single_blocks.0.linear1.lora_B.weight"].shape == (3 * 32 + 128, 4 * RANK)
    assert float(comfy["diffusion_model.single_blocks.1.modulation.lin.alpha"]) == RANK
    base = load_file(str(hunyuan_image_run.parent.parent / "model" / "transformer" /
                         "diffusion_pytorch_model.safetensors"))
    table = comfyui_layout(layout_for_model_keys(base, 32))  # the model as ComfyUI's HunyuanVideo class holds it
    native = table.to_original(base)
    patched = apply_file({f"diffusion_model.{k}": v for k, v in native.items()}, comfy, generic_key_map(native))
    got = table.to_model({k.removeprefix("diffusion_model."): v for k, v in patched.items()}, "ComfyUI")
    params = runs.checkpoint_params(hunyuan_image_run)
    runs.assert_state_close(got, runs.merge_peft(base, params, ALPHA / RANK), atol=1e-5)
