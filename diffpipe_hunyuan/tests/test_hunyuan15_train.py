"""HunyuanVideo-1.5 end-to-end through the real CLI (DeepSpeed on gloo, the real cache, peft), one shared 1-process
run per entry point (conftest.py): mixed clips and images, the loss falls; the saved diffusers LoRA loads with
``transformer.load_lora_adapter`` (the 1.5 pipelines have no ``load_lora_weights``) and reproduces the trained
transformer; the ComfyUI file holds exactly keys ComfyUI's key map has for the model (its fused ``img_attn.qkv``
names, alpha scaled with the fused rank) and applies like the separate LoRAs. The image-to-video run also trains a
few steps on 2 pipeline stages from its cache, repeating its first losses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.comfy import apply_file, generic_key_map
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_hunyuan.original15 import diffusers_to_original, layout_for_model_keys, original_to_diffusers
from diffpipe_hunyuan.testing import write_clip_dataset
from diffpipe_hunyuan.testing15 import original_path, qwen_tokenizer, template_crop_start

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, OTHER_STEPS = 4, 8.0, 16, 4
SAMPLE = {"prompts": ["a red cat"], "before_first_step": True, "steps": 2, "seed": 5, "resolution": 32}
CAPTIONS = ["a red cat", "a blue dog", 'a sign saying "open"', "a small house"]
PIPELINES = {
    "hunyuan-video-1.5": "HunyuanVideo15Pipeline",
    "hunyuan-video-1.5-i2v": "HunyuanVideo15ImageToVideoPipeline",
}


def train_project(root: Path, model_type: str, model: Path) -> Path:
    """:func:`write_project`, trained in 1 process. Returns the run folder."""
    return runs.train(root, write_project(root, model_type, model), 1, timeout=600, OMP_NUM_THREADS="1")


def write_project(root: Path, model_type: str, model: Path) -> Path:
    """A copy of the tiny ``model`` folder (and its single file) of ``model_type``, 4 clips of 5 frames and 4 images
    at 32x32, and a LoRA run (``run.toml``): text-to-video from Tencent's single file, image-to-video from the
    folder. Returns the run config."""
    i2v = model_type.endswith("i2v")
    shutil.copytree(model, root / "model")
    shutil.copy(original_path(model), original_path(root / "model"))
    data = root / "data"
    write_clip_dataset(data / "clips", [6] * 4, CAPTIONS, size=(32, 32), fps=24)
    write_image_dataset(data / "images", 4, size=(32, 32), captions=[f"a photo of {c[2:]}" for c in CAPTIONS])
    write_dataset_toml(root / "dataset.toml", data, resolutions=[32], enable_ar_bucket=False, frame_buckets=[1, 5])
    table = {"type": model_type, "text_max_length": 8, "glyph_max_length": 8, "timestep_sample_method": "uniform"}
    table["text_crop_start"] = template_crop_start(qwen_tokenizer())
    if not i2v:
        table["diffusion_model"] = original_path(root / "model").name
    top = {"max_steps": STEPS, "gradient_accumulation_steps": 2, "seed": 7, "checkpoint_every_n_steps": STEPS}
    sample = None if i2v else SAMPLE
    (root / "run.toml").write_text(runs.lora_run_toml(table, 1.5e-2, sample, RANK, ALPHA, **top))
    return root / "run.toml"


@pytest.fixture(params=list(PIPELINES))
def run(request: pytest.FixtureRequest) -> Path:
    """Each entry point's shared run."""
    return request.getfixturevalue("hunyuan15_i2v_run" if request.param.endswith("i2v") else "hunyuan15_run")


def test_mixed_clips_and_images_train_and_the_loss_falls(run: Path) -> None:
    runs.assert_loss_falls(run, STEPS, 4)
    columns: dict[str, set[int]] = {}
    for shard in (run.parent.parent / "cache").rglob("*.arrow"):
        table = Dataset.from_file(str(shard))
        if "latents" in table.column_names:
            frames = len(table["latents"][0][0])  # (C, F, h, w)
            columns.setdefault(frames, set()).update(table.column_names)
    assert set(columns) == {1, 2}, columns  # images: 1 latent frame, 5-frame clips: 2
    i2v = "i2v" in run.parent.parent.name
    assert ("first_frame_latents" in columns[2]) == i2v and "first_frame_latents" not in columns[1]
    assert ("image_embeds" in columns[2]) == i2v


def transformer_inputs(conditioned: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 4:] = 0
    glyph_mask = torch.zeros(2, 8, dtype=torch.long)
    glyph_mask[1, :3] = 1
    return {
        "hidden_states": torch.randn(2, 9, 2, 2, 2, generator=g),
        "timestep": torch.rand(2, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "encoder_attention_mask": mask,
        "encoder_hidden_states_2": torch.randn(2, 8, 24, generator=g),
        "encoder_attention_mask_2": glyph_mask,
        "image_embeds": torch.randn(2, 16, 16, generator=g) if conditioned else torch.zeros(2, 16, 16),
    }


@pytest.mark.parametrize("route", ["folder and weight_name", "file path"])
def test_diffusers_lora_loads_with_load_lora_adapter_and_reproduces(run: Path, route: str) -> None:
    import diffusers
    from diffusers import HunyuanVideo15Transformer3DModel

    model_dir, saved = run.parent.parent / "model", run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    assert all(k.startswith("transformer.transformer_blocks.") for k in state)
    assert "transformer.transformer_blocks.1.attn.to_q.lora_B.weight" in state
    assert not any(".1.attn.add_q_proj." in k or ".1.ff_context." in k for k in state)  # the last block's dead ends
    trained = (
        "transformer_blocks.0.attn.add_q_proj.lora_A.default.weight",
        "transformer_blocks.1.ff.net.2.lora_B.default.weight",
    )
    reference = runs.trained_transformer(
        HunyuanVideo15Transformer3DModel, run, model_dir, RANK, ALPHA, cfg["target_modules"], trained
    )
    name = PIPELINES[runs_model_type(run)]
    pipe = getattr(diffusers, name).from_pretrained(str(model_dir), local_files_only=True)
    assert not hasattr(pipe, "load_lora_weights")  # why the README points at load_lora_adapter
    inputs = transformer_inputs(name.endswith("ImageToVideoPipeline"))
    untrained = runs.outputs(pipe.transformer, inputs)
    with runs.library_warnings() as warnings:
        if route == "file path":  # as users call it: diffusers builds the adapter with its default alpha (= rank)
            pipe.transformer.load_lora_adapter(str(saved / "adapter_model.safetensors"), adapter_name="trained")
        else:
            pipe.transformer.load_lora_adapter(
                str(saved), weight_name="adapter_model.safetensors", prefix="transformer", adapter_name="trained"
            )
    assert not [m for m in warnings if "keys" in m.lower()], warnings
    assert pipe.transformer.peft_config["trained"].lora_alpha == RANK
    # trained with alpha != rank, saved folded: reproducing the outputs proves the strength arrives
    runs.assert_reproduces(runs.outputs(pipe.transformer, inputs), runs.outputs(reference, inputs), untrained)


def runs_model_type(run: Path) -> str:
    return "hunyuan-video-1.5-i2v" if "i2v" in run.parent.parent.name else "hunyuan-video-1.5"


def comfy_layout(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The transformer as ComfyUI's HunyuanVideo model holds it (fused q, k, v under ComfyUI's names, where the table
    names them), and ComfyUI name -> fused-layout name."""
    table = layout_for_model_keys(state, int(state["transformer_blocks.0.attn.to_q.weight"].shape[0]), fused=True)
    names = {m.comfy_name: m.original for m in table.modules if m.comfy_name}
    back = {v: k for k, v in names.items()}
    fused = diffusers_to_original(state, fused=True)
    out = {}
    for key, value in fused.items():
        module, _, param = key.rpartition(".")
        out[f"{back.get(module, module)}.{param}"] = value
    return out, names


def test_comfyui_lora_has_comfyui_keys_and_applies_like_the_separate_loras(run: Path) -> None:
    comfy = load_file(str(run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].shape == (3 * RANK, 32)
    assert float(comfy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"]) == 3 * RANK
    # the last block's text queries are not adapted: its txt_attn.qkv LoRA holds k and v only
    assert comfy["diffusion_model.double_blocks.1.txt_attn.qkv.lora_B.weight"].shape == (3 * 32, 2 * RANK)
    assert float(comfy["diffusion_model.double_blocks.1.txt_attn.qkv.alpha"]) == 2 * RANK
    assert float(comfy["diffusion_model.double_blocks.1.img_mod.lin.alpha"]) == RANK

    base = load_file(str(run.parent.parent / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))
    weights, names = comfy_layout(base)
    prefixed = {f"diffusion_model.{k}": v for k, v in weights.items()}
    patched = apply_file(prefixed, comfy, generic_key_map(weights))  # raises on a key ComfyUI would not load
    fused = {}
    for key, value in patched.items():
        module, _, param = key[len("diffusion_model."):].rpartition(".")
        fused[f"{names.get(module, module)}.{param}"] = value
    merged = runs.merge_peft(base, runs.checkpoint_params(run), ALPHA / RANK)
    runs.assert_state_close(original_to_diffusers(fused), merged, atol=1e-5)
    moved = [k for k in merged if k.endswith("attn.add_k_proj.weight") and not torch.equal(merged[k], base[k])]
    assert len(moved) == 2


def test_i2v_trains_on_two_stages_from_the_cache_as_in_one_process(hunyuan15_i2v_run: Path) -> None:
    root = hunyuan15_i2v_run.parent.parent
    text = (root / "run.toml").read_text()
    text = text.replace(f"max_steps = {STEPS}", f"max_steps = {OTHER_STEPS}")
    text = text.replace(f"checkpoint_every_n_steps = {STEPS}", f"checkpoint_every_n_steps = {OTHER_STEPS}")
    (root / "two_stages.toml").write_text(text.replace("seed = 7", "seed = 7\npipeline_stages = 2"))
    run, output = runs.train_with_output(root, "two_stages.toml", 2, timeout=600, OMP_NUM_THREADS="1")
    assert "media encoded 0" in output, output[-2000:]
    runs.assert_trained_in_stages(run, OTHER_STEPS, 2)
    assert runs.losses(run) == pytest.approx(runs.losses(hunyuan15_i2v_run)[:OTHER_STEPS], rel=1e-4)


def test_sample_before_the_first_step_is_the_pipelines_as_an_mp4(hunyuan15_run: Path) -> None:
    """Sampled through the pipeline engine before the first step (LoRA B = 0: the base model): the MP4 has the
    dataset's 5 frames at 24 fps, and its latents are ``HunyuanVideo15Pipeline``'s for the same prompt, seed and
    steps (no guidance: ``[sample] cfg``'s default)."""
    from diffusers import HunyuanVideo15Pipeline

    from diffpipe_core.sampling.loop import noise_generator
    from diffpipe_core.testing.media import assert_video_sample_point

    folder = hunyuan15_run / "samples" / "step-0000000"
    assert_video_sample_point(folder, fps=24, frames=5)
    got = load_file(str(folder / "latents.safetensors"))["sample_00"]
    pipe = HunyuanVideo15Pipeline.from_pretrained(str(hunyuan15_run.parent.parent / "model"), local_files_only=True)
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 8, 8  # the run's text and glyph lengths
    pipe.prompt_template_encode_start_idx = template_crop_start(qwen_tokenizer())
    pipe.guider = pipe.guider.new(guidance_scale=1.0)
    expected = pipe(
        prompt="a red cat",
        latents=torch.randn(1, 4, 2, 2, 2, generator=noise_generator(5, 0)),  # the core's noise for seed 5, prompt 0
        num_inference_steps=2, height=32, width=32, num_frames=5, output_type="latent",
    ).frames
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)
