"""LTX-2 end-to-end through the real CLI (DeepSpeed on gloo, the real cache, peft): the shared 1-process run
(conftest ``ltx2_run``: 4 mp4 clips and 4 PNG images, first-frame conditioning p = 0.5, a sample after the last step)
and, from its cache, a few steps on 2 pipeline stages whose losses are the shared run's first ones. The loss falls;
the diffusers LoRA loads through ``LTX2Pipeline.load_lora_weights`` and reproduces the trained transformer (the video
branch changed, the audio prediction still finite); the ComfyUI file has exactly the keys ComfyUI's key map accepts
for LTX-2 (``diffusion_model.<module>`` of the native ``LTXAVModel``, with ``.alpha``), and applied to the
original-layout weights equals the diffusers LoRA merged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.comfy import apply_file, generic_key_map
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_ltx.ltx2_original import diffusers_name, to_original
from diffpipe_ltx.ltx2_testing import write_clips, write_tiny_ltx2

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8.0
STEPS, TWO_STAGE_STEPS = 16, 3
MODEL = {"type": "ltx-2", "max_sequence_length": 16, "timestep_sample_method": "uniform",
         "first_frame_conditioning_p": 0.5}
CAPTIONS = ["a red car", "a blue river", "a green tree", "a dark city", "a cat", "a dog", "a house", "a sky"]
SAMPLE = {"prompts": ["a red car"], "every_n_steps": STEPS, "steps": 2, "seed": 5, "resolution": 64, "frames": 9}


def make_project(root: Path, stages: int = 1, steps: int = STEPS, sample: bool = True) -> Path:
    """The tiny LTX-2, its data and ``run.toml`` (or ``stages.toml`` for another layout) in ``root``."""
    if not (root / "model").exists():
        write_tiny_ltx2(root / "model")
        data = root / "data"
        write_image_dataset(data, 4, size=(64, 64), captions=CAPTIONS[4:])
        write_clips(data, CAPTIONS[:4], frames=12, size=(64, 64))
        write_dataset_toml(root / "dataset.toml", data, resolutions=[64], enable_ar_bucket=False, frame_buckets=[1, 9])
    top = {"output_dir": f"out{stages}", "max_steps": steps, "gradient_accumulation_steps": 2,
           "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3}
    if stages == 2:
        top["partition_split"] = [2]  # embedders + block 0 | block 1 + output: every between-block tensor crosses
    text = runs.lora_run_toml(MODEL, 1e-2, SAMPLE if sample else None, RANK, ALPHA, **top)
    name = "run.toml" if stages == 1 else "stages.toml"
    (root / name).write_text(text)
    return root / name


def test_trains_on_clips_and_images_and_the_loss_falls(ltx2_run: Path) -> None:
    runs.assert_loss_falls(ltx2_run, STEPS, STEPS // 4)
    from diffpipe_core.data.cache_store import list_shards

    tables = {arrow.parent.parent for arrow in (ltx2_run.parent.parent / "cache").rglob("data.arrow")}
    columns = [s.columns for t in tables for s in list_shards(t)]
    shapes = {c["latents"][0] for c in columns if "latents" in c}
    assert shapes == {(4, 1, 2, 2), (4, 2, 2, 2)}, shapes  # images (1 latent frame) and 9-frame clips (2)
    assert any("first_frame_latents" in c for c in columns)  # the clips' first frames, through the core


def test_two_pipeline_stages_train_as_the_one_process_run(ltx2_run: Path) -> None:
    root = ltx2_run.parent.parent
    config = make_project(root, stages=2, steps=TWO_STAGE_STEPS, sample=False)
    run = runs.train(root, config.name, procs=2, timeout=400)
    runs.assert_trained_in_stages(run, TWO_STAGE_STEPS, 2)
    assert runs.losses(run) == pytest.approx(runs.losses(ltx2_run)[:TWO_STAGE_STEPS], rel=1e-4)


def transformer_inputs(video_text: int = 16, audio_text: int = 16) -> dict:
    """One call of the tiny transformer; the text widths are LTX-2.0's (the caption width, 16) unless given (LTX-2.3:
    each stream's, 32 and 16)."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, 8, 4, generator=g),
        "audio_hidden_states": torch.randn(1, 9, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 16, video_text, generator=g),
        "audio_encoder_hidden_states": torch.randn(1, 16, audio_text, generator=g),
        "timestep": torch.tensor([400.0]),
        "sigma": torch.tensor([400.0]),
        "encoder_attention_mask": torch.ones(1, 16),
        "audio_encoder_attention_mask": torch.ones(1, 16),
        "num_frames": 2, "height": 2, "width": 2, "fps": 24.0, "audio_num_frames": 9, "use_cross_timestep": True,
    }


def both_outputs(model, inputs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model(**(inputs or transformer_inputs()), return_dict=False)


def lora_outputs(run: Path, rank: int, alpha: float, trained: tuple[str, ...], inputs: dict | None = None):
    """``(untrained, loaded, expected)``: the ``(video, audio)`` outputs of ``LTX2Pipeline``'s transformer of the run's
    folder before and after ``load_lora_weights`` of the run's diffusers LoRA, and of the transformer with the run's
    trained LoRA tensors (holding ``trained``), on ``inputs``; and the saved LoRA's tensors."""
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    saved, model_dir = run / "saved" / "final", run.parent.parent / "model"
    state, cfg = runs.read_saved_lora(saved, rank, alpha)
    reference = runs.trained_transformer(LTX2VideoTransformer3DModel, run, model_dir, rank, alpha,
                                         cfg["target_modules"], trained)
    pipe = LTX2Pipeline.from_pretrained(str(model_dir), local_files_only=True)
    untrained = both_outputs(pipe.transformer, inputs)
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    return untrained, both_outputs(pipe.transformer, inputs), both_outputs(reference, inputs), state


def test_diffusers_lora_loads_in_ltx2_pipeline_and_reproduces(ltx2_run: Path) -> None:
    trained = ("transformer_blocks.1.attn2.to_k.lora_A.default.weight",)
    (untrained_video, _), (video, audio), (expected_video, expected_audio), state = lora_outputs(
        ltx2_run, RANK, ALPHA, trained)
    assert "transformer.transformer_blocks.0.attn1.to_q.lora_A.weight" in state
    assert "transformer.transformer_blocks.1.ff.net.2.lora_B.weight" in state
    assert not any("audio" in k for k in state)  # the audio branch is not trained
    runs.assert_reproduces(video, expected_video, untrained_video)  # alpha != rank: the strength applied too
    torch.testing.assert_close(audio, expected_audio, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(audio).all()


def test_comfyui_file_has_the_keys_comfyui_maps_and_applies_like_diffusers(ltx2_run: Path) -> None:
    modules = assert_comfyui_file(ltx2_run, RANK)
    assert len(modules) == 2 * (2 * 4 + 2)  # 2 blocks x (attn1 + attn2 q/k/v/out, ff in/out)


def assert_comfyui_file(run: Path, rank: int) -> set[str]:
    """The run's ComfyUI file holds, for each module of its diffusers LoRA, ``diffusion_model.<module>``'s
    ``lora_A`` / ``lora_B`` weights and ``.alpha`` (= rank: the trained strength is folded in); ComfyUI's key map for
    the native LTXAVModel (every weight's module under ``diffusion_model.``) takes each stem, and patched into the
    original-layout weights they equal the diffusers LoRA merged into the folder's weights. Returns the modules."""
    saved, model_dir = run / "saved" / "final", run.parent.parent / "model"
    comfy = load_file(str(saved / "adapter_model.comfyui.safetensors"))
    diffusers_file = load_file(str(saved / "adapter_model.safetensors"))
    modules = {k[len("transformer.") : -len(".lora_A.weight")] for k in diffusers_file if k.endswith(".lora_A.weight")}
    expected = {f"diffusion_model.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert set(comfy) == expected
    assert all(float(comfy[f"diffusion_model.{m}.alpha"]) == rank for m in modules)

    base = load_file(str(model_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    native = {f"diffusion_model.{k}": v for k, v in to_original(base).items()}
    key_map = generic_key_map(to_original(base))
    assert all(f"diffusion_model.{m}" in key_map for m in modules)
    applied = apply_file(native, comfy, key_map)
    peft = {k.replace("transformer.", "", 1).replace(".lora_A.weight", ".lora_A.default.weight")
             .replace(".lora_B.weight", ".lora_B.default.weight"): v for k, v in diffusers_file.items()}
    merged = runs.merge_peft(base, peft, 1.0)  # the saved file has the trained alpha / rank folded in
    runs.assert_state_close({diffusers_name(k[len("diffusion_model."):], 2): v for k, v in applied.items()}, merged)
    return modules
