"""End to end through the real CLI (DeepSpeed on gloo, the real cache, peft), on the one shared run (conftest's
``zimage_run``): the loss falls; the saved diffusers LoRA loads through ZImagePipeline.load_lora_weights and
reproduces the trained transformer; the ComfyUI file holds exactly the native module names ComfyUI's Z-Image key map
accepts, with alpha, and applies to the original-layout weights like the separate LoRAs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_zimage.original import diffusers_to_original, original_to_diffusers
from diffpipe_zimage.testing import apply_comfyui_lora, write_tiny_zimage

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 16
MODEL = {"type": "z-image", "text_max_length": 24, "shift": 1.0}


def run_config(model: dict = MODEL, **top: object) -> str:
    """The project's run config: 1 process, micro-batches of 4, ``STEPS`` steps; ``top`` changes the top-level keys."""
    top = {"micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "pipeline_stages": 1, "seed": 7, **top}
    top = {"max_steps": STEPS, "checkpoint_every_n_steps": STEPS, **top}
    return runs.lora_run_toml(model, 1e-2, None, RANK, ALPHA, **top)


def make_project(root: Path) -> Path:
    """The tiny model, 4 captioned 32x32 images and ``run.toml`` in ``root``."""
    write_tiny_zimage(root / "model")
    captions = ["a red cat", "a blue dog", "a green tree", "a small house"]
    write_image_dataset(root / "data", 4, size=(32, 32), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[32], enable_ar_bucket=False)
    (root / "run.toml").write_text(run_config())
    return root


def test_loss_falls(zimage_run: Path) -> None:
    runs.assert_loss_falls(zimage_run, STEPS, window=4)
    assert runs.stage_files(zimage_run) == ["params-stage0.safetensors"]


def transformer_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": list(torch.randn(2, 4, 1, 4, 4, generator=g)),
        "t": torch.rand(2, generator=g),
        "cap_feats": [torch.randn(7, 32, generator=g), torch.randn(19, 32, generator=g)],
    }


def stacked(transformer):
    """The transformer called like ``runs.outputs`` wants it: its list of per-image outputs stacked."""
    return lambda **kw: SimpleNamespace(sample=torch.stack(transformer(**kw).sample))


def test_diffusers_lora_loads_in_zimage_pipeline_and_reproduces(zimage_run: Path) -> None:
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    model_dir = zimage_run.parent.parent / "model"
    saved = zimage_run / "saved" / "final"
    holding = ("layers.1.adaLN_modulation.0.lora_B.weight", "context_refiner.0.attention.to_q.lora_A.weight")
    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding)
    reference = runs.with_trained_lora(
        ZImageTransformer2DModel.from_pretrained(str(model_dir / "transformer")), zimage_run, RANK, ALPHA,
        cfg["target_modules"],
    )
    pipe = ZImagePipeline.from_pretrained(str(model_dir), local_files_only=True)
    untrained = runs.outputs(stacked(pipe.transformer), transformer_inputs())
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    assert pipe.transformer.peft_config["trained"].lora_alpha == RANK
    # trained with alpha != rank, saved folded: reproducing the outputs proves the strength arrives
    got = runs.outputs(stacked(pipe.transformer), transformer_inputs())
    runs.assert_reproduces(got, runs.outputs(stacked(reference), transformer_inputs()), untrained)


def test_comfyui_lora_keys_and_fused_weights(zimage_run: Path) -> None:
    model_dir = zimage_run.parent.parent / "model"
    comfy = load_file(str(zimage_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in comfy}
    block = ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    expected = {f"diffusion_model.{g}.{i}.{m}" for g in ("noise_refiner", "context_refiner", "layers")
                for i in range(2) for m in block}
    expected |= {f"diffusion_model.{g}.{i}.adaLN_modulation.0" for g in ("noise_refiner", "layers") for i in range(2)}
    assert modules == expected
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight", ".alpha")) for k in comfy) and len(comfy) == 3 * len(
        expected
    )
    assert comfy["diffusion_model.layers.0.attention.qkv.lora_B.weight"].shape == (96, 3 * RANK)
    assert float(comfy["diffusion_model.layers.0.attention.qkv.alpha"]) == 3 * RANK
    assert float(comfy["diffusion_model.layers.1.feed_forward.w2.alpha"]) == RANK

    base = load_file(str(model_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    got = original_to_diffusers(apply_comfyui_lora(diffusers_to_original(base), comfy))
    runs.assert_state_close(got, runs.merge_peft(base, runs.checkpoint_params(zimage_run), ALPHA / RANK))


def test_a_format_the_targets_cannot_make_is_refused_before_any_work(tmp_path: Path) -> None:
    """Issue 37.11: ComfyUI's Z-Image keys fuse q/k/v into one ``qkv``; a LoRA on ``to_q`` alone cannot be written in
    that format. Said before caching or a run folder, not as 'not written' after the whole run."""
    root = make_project(tmp_path)
    (root / "run.toml").write_text(run_config().replace("[adapter]\n", '[adapter]\ntarget_modules = ["to_q"]\n'))
    result = runs.run_diffpipe(["train", "--config", "run.toml"], cwd=root, timeout=300)
    assert result.returncode == 1, result.output[-3000:]
    lines = [line for line in result.stderr.splitlines() if "adapter.save_formats" in line]
    assert len(lines) == 1 and "'comfyui' cannot be written for these targets" in lines[0], result.stderr
    assert "to_k" in lines[0]  # the part without a LoRA
    assert not (root / "out").exists()
    assert [p.name for p in (root / "cache").iterdir()] == ["scan"]  # what the scan learnt; nothing encoded
    (root / "run.toml").write_text(run_config().replace("[adapter]\n", '[adapter]\ntarget_modules = ["to_q"]\n')
                                   .replace("['diffusers', 'comfyui']", "['diffusers']"))
    assert runs.run_diffpipe(["validate", "--config", "run.toml"], cwd=root, timeout=300).returncode == 0
