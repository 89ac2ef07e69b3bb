"""End to end through the real CLI (DeepSpeed on gloo, the real cache and audio path, peft), on the one shared run
(conftest's ``minimax_run``: video and audio trained, CFG-augmented, on the pruned (curve-form) transformer file
diffusion-pipe's example names, beside the folder): the loss falls and the run's 22-frame sample (sampled from the
pruned base) is an mp4 with a stereo sound track; the LoRA leaves the AdaLN
projections alone; the saved diffusers LoRA loads on the full model through the modular pipeline's
``load_lora_weights`` and reproduces the trained transformer's video and audio outputs (the pruned one's, at the
table's grid times); the ComfyUI file is in the reference layout (fused ``qkv_proj``,
``mlp.fc1`` halves swapped), applies as ComfyUI applies it to the trained weights, and diffusers' own converter of
such files loads it to the same outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_clip_dataset, write_dataset_toml, write_image_dataset
from diffpipe_minimax.testing import pruned_file, write_tiny_minimax

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 12
SAMPLE = {"prompts": ["a bell rings"], "every_n_steps": STEPS, "steps": 2, "seed": 5, "resolution": 64, "frames": 22}
MODEL = {"type": "minimax-h3", "text_max_length": 16, "train_audio": True, "cfg": 2.0,
         "timestep_sample_method": "uniform", "shift": 1.0}
PRUNED = "minimax_h3_fl2va_pruned.safetensors"  # the transformer trained: the pruned (curve-form) file


def make_project(root: Path) -> Path:
    """The tiny model (the folder, and its transformer as a pruned file of 1025 grid rows beside it), 2 tone clips of
    5 frames at 24 fps and 2 images (64x64), and ``run.toml`` in ``root``."""
    pruned_file(write_tiny_minimax(root / "model"), root / PRUNED)
    data = root / "data"
    write_clip_dataset(data, 5, ["a bell rings", "a high tone"], size=(64, 64), fps=24, audio="tone")
    write_image_dataset(data, 2, size=(64, 64), captions=["a red cat", "a blue dog on a tree"])
    write_dataset_toml(root / "dataset.toml", data, resolutions=[64], enable_ar_bucket=False, frame_buckets=[1, 5])
    top = {"max_steps": STEPS, "checkpoint_every_n_steps": STEPS, "gradient_accumulation_steps": 2, "seed": 7,
           "micro_batch_size_per_gpu": 1}
    model = {"path": "model", "diffusion_model": PRUNED, "dtype": "float32", "encoder_dtype": "float32", **MODEL}
    adapter = {"rank": RANK, "alpha": ALPHA, "save_formats": ["diffusers", "comfyui"]}
    (root / "run.toml").write_text(runs.run_toml(model, {"lr": 2e-2}, adapter, SAMPLE, **top))
    return root


def test_loss_falls_and_the_sample_has_sound(minimax_run: Path) -> None:
    import av

    runs.assert_loss_falls(minimax_run, STEPS, window=3)
    assert runs.stage_files(minimax_run) == ["params-stage0.safetensors"]
    (mp4,) = sorted((minimax_run / "samples").rglob("*.mp4"))
    with av.open(str(mp4)) as container:
        assert container.streams.video[0].frames in (0, 22) and sum(1 for _ in container.decode(video=0)) == 22
        stream = container.streams.audio[0]
        assert stream.rate == 8000 and stream.codec_context.channels == 2  # the tiny audio VAE's rate, stereo


def transformer_inputs(text_len: int = 3, audio_len: int = 8, times: tuple[float, float] = (0.3, 0.6)) -> dict:
    """One item of the tiny transformer's inputs on the pipeline's layout (2 x 2 latent rows a frame, 2 frames)."""
    from diffpipe_minimax.packing import layout

    g = torch.Generator().manual_seed(0)
    lay = layout(text_len, (2, 4, 4), audio_len, (1, 2, 2))
    return {"hidden_states": torch.randn(1, 8, 16, generator=g), "audio_hidden_states": torch.randn(1, 16, 8,
            generator=g), "encoder_hidden_states": torch.randn(1, text_len, 32, generator=g),
            "timestep": torch.tensor(times), "timestep_indices": lay.timestep_indices,
            "token_tags": lay.token_tags, "position_ids": lay.position_ids, "video_indices": lay.video_indices,
            "audio_indices": lay.audio_indices, "text_indices": torch.arange(text_len)}


def both(model: torch.nn.Module, times: tuple[float, float] = (0.3, 0.6)) -> torch.Tensor:
    """The video and the audio output of ``model`` on :func:`transformer_inputs`, side by side."""
    with torch.no_grad():
        out = model(**transformer_inputs(times=times), return_dict=False)
    return torch.cat([out[0].flatten(), out[1].flatten()])


def test_lora_leaves_adaln_out_and_loads_in_the_modular_pipeline(minimax_run: Path) -> None:
    from diffusers import MiniMaxH3Transformer3DModel

    from diffpipe_minimax.testing import modular_pipeline

    saved, model_dir = minimax_run / "saved" / "final", minimax_run.parent.parent / "model"
    holding = ("transformer_blocks.1.attn.to_q.lora_A.weight", "token_refiner.refiner_blocks.0.ff.net.2.lora_B.weight")
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding)
    modules = {k.split(".lora_")[0] for k in state}
    assert not [m for m in modules if "adaln" in m or "norm_out" in m or "proj_in" in m], sorted(modules)
    assert {m.rsplit(".", 2 if m.endswith(("to_out.0", "net.0.proj", "net.2")) else 1)[0] for m in modules} >= {
        "transformer.transformer_blocks.0.attn", "transformer.token_refiner.refiner_blocks.0.ff"}
    reference = runs.trained_transformer(MiniMaxH3Transformer3DModel, minimax_run, model_dir, RANK, ALPHA,
                                         cfg["target_modules"], ("transformer_blocks.0.ff.net.0.proj",))
    pipe = modular_pipeline(model_dir)
    untrained = both(pipe.transformer)
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    # trained with alpha != rank, saved folded: reproducing both streams proves the strength arrives
    runs.assert_reproduces(both(pipe.transformer), both(reference), untrained)
    # the model trained: the pruned file with the trained LoRA, at times on its table's grid (1025 rows)
    from diffpipe_minimax.plugin import plugin as minimax

    model_cfg = minimax.spec.config_schema(type="minimax-h3", path=model_dir, dtype="float32",
                                           diffusion_model=model_dir.parent / PRUNED, encoder_dtype="float32")
    pruned = runs.with_trained_lora(minimax.load_diffusion_model(model_cfg, torch.device("cpu"), torch.float32),
                                    minimax_run, RANK, ALPHA, cfg["target_modules"])
    grid = (0.25, 0.625)  # rows 256 and 640 of 1025
    torch.testing.assert_close(both(pipe.transformer, grid), both(pruned, grid), rtol=1e-4, atol=1e-5)


def test_comfyui_lora_is_the_reference_layout_and_loads_in_diffusers(minimax_run: Path) -> None:
    from diffusers import MiniMaxH3Transformer3DModel
    from safetensors.torch import load_file

    from diffpipe_minimax.original import layout_for_config
    from diffpipe_minimax.testing import modular_pipeline

    saved, model_dir = minimax_run / "saved" / "final", minimax_run.parent.parent / "model"
    file = load_file(str(saved / "adapter_model.comfyui.safetensors"))
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in file}
    expected = {f"diffusion_model.{b}.{m}" for b in ("blocks.0", "blocks.1", "token_refiner.blocks.0")
                for m in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    assert modules == expected, sorted(modules ^ expected)
    assert float(file["diffusion_model.blocks.0.attn.qkv_proj.alpha"]) == 3 * RANK  # fused: ranks add, alpha too

    base_model = MiniMaxH3Transformer3DModel.from_pretrained(str(model_dir / "transformer"))
    table = layout_for_config(dict(base_model.config))
    base = base_model.state_dict()
    applied = runs.apply_comfyui(table.to_original(base), file)
    trained = table.to_original(runs.merge_peft(base, runs.checkpoint_params(minimax_run), ALPHA / RANK))
    runs.assert_state_close(applied, trained, atol=1e-5)

    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    reference = runs.with_trained_lora(MiniMaxH3Transformer3DModel.from_pretrained(str(model_dir / "transformer")),
                                       minimax_run, RANK, ALPHA, cfg["target_modules"])
    pipe = modular_pipeline(model_dir)
    untrained = both(pipe.transformer)
    pipe.load_lora_weights(str(saved), weight_name="adapter_model.comfyui.safetensors", adapter_name="comfy")
    runs.assert_reproduces(both(pipe.transformer), both(reference), untrained, atol=1e-4)
