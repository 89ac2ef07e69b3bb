"""FLUX.3's shared training runs (the CLI: DeepSpeed, the real cache, peft), one per entry point: ``flux3`` in 1
process (the loss falls, a CFG sample before the first step, the golden LoRA) and ``flux3-distilled`` on 2 pipeline
stages in 2 processes with CFG-augmented training (``[model] cfg``), its captions of two text windows in one
micro-batch. The saved diffusers LoRA loads through the modular pipeline's ``load_lora_weights``
(``Flux3LoraLoaderMixin``) and reproduces the trained transformer; the ComfyUI-layout file (BFL's names under
``diffusion_model.``) loads through the same loader, as FLUX.3's non-diffusers format, and reproduces it too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.golden import assert_matches
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_flux.testing_flux3 import modular_pipeline, write_tiny_flux3

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, DISTILLED_STEPS = 4, 8.0, 10, 3
SAMPLE = {"prompts": ["a red cat"], "negative_prompt": "blurry", "cfg": 3.0, "steps": 2, "before_first_step": True}
GOLDEN = Path(__file__).parent / "golden"
#: the last caption is longer than one text window of 80 tokens: its window is text_max_length's 100
CAPTIONS = ["a red cat", "a blue dog", "a green tree", " ".join(["a small house by the river"] * 16)]


def project(name: str, distilled: bool, stages: int, steps: int, tmp_path_factory, **model: object) -> Path:
    root = tmp_path_factory.mktemp(name)
    write_tiny_flux3(root / "model", distilled=distilled)
    write_image_dataset(root / "data", 4, size=(32, 32), captions=CAPTIONS)
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[32], enable_ar_bucket=False)
    table = {"type": name, "text_max_length": 100, "timestep_sample_method": "uniform", **model}
    sample = SAMPLE if not distilled else {**SAMPLE, "cfg": 1.0, "negative_prompt": ""}
    top = {"max_steps": steps, "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3}
    if stages > 1:
        top["partition_split"] = [3]
    (root / "run.toml").write_text(runs.lora_run_toml(table, 5e-2, sample, RANK, ALPHA, **top))
    return runs.train(root, "run.toml", stages)


@pytest.fixture(scope="module")
def flux3_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared ``flux3`` run (1 process). Its run folder."""
    return project("flux3", False, 1, STEPS, tmp_path_factory)


@pytest.fixture(scope="module")
def distilled_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared ``flux3-distilled`` run: 2 stages in 2 processes, CFG-augmented at 3.5. Its run folder."""
    return project("flux3-distilled", True, 2, DISTILLED_STEPS, tmp_path_factory, cfg=3.5)


def test_the_loss_falls_a_sample_is_written_and_the_lora_is_golden(flux3_run: Path) -> None:
    runs.assert_loss_falls(flux3_run, STEPS, 3)
    names = sorted(p.name for p in (flux3_run / "samples" / "step-0000000").iterdir())
    assert "00-a-red-cat.png" in names, names
    assert_matches(flux3_run / "saved" / "final", GOLDEN / "flux3.json")


def test_distilled_trains_on_two_stages_with_cfg(distilled_run: Path) -> None:
    losses = runs.assert_trained_in_stages(distilled_run, DISTILLED_STEPS, 2)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert (distilled_run / "samples" / "step-0000000" / "00-a-red-cat.png").is_file()


def transformer_inputs(flow_map: bool, seed: int = 0) -> dict:
    from diffpipe_flux.flux3_layers import image_ids, text_ids

    g = torch.Generator().manual_seed(seed)
    t = torch.rand(2, generator=g)
    extra = {"target_timestep": t * 0.5} if flow_map else {}
    return {"hidden_states": torch.randn(2, 4, 16, generator=g), "encoder_hidden_states": torch.randn(2, 5, 256,
            generator=g), "timestep": t, "img_ids": image_ids(2, 2), "txt_ids": text_ids(5), **extra}


def reference(run: Path, saved: Path):
    from diffusers import Flux3Transformer2DModel

    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    model = Flux3Transformer2DModel.from_pretrained(str(run.parent.parent / "model" / "transformer"))
    return runs.with_trained_lora(model, run, RANK, ALPHA, cfg["target_modules"])


def test_diffusers_lora_loads_in_the_modular_pipeline_and_reproduces(flux3_run: Path) -> None:
    saved = flux3_run / "saved" / "final"
    runs.read_saved_lora(saved, RANK, ALPHA, holding=(
        "txt_mode_blocks.0.attn.to_q.lora_A.weight", "mode_blocks.image.0.ff.linear_out.lora_B.weight",
        "single_transformer_blocks.1.attn.to_out.0.lora_A.weight"))
    pipe = modular_pipeline(flux3_run.parent.parent / "model")
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference(flux3_run, saved),
                                transformer_inputs(False), ALPHA)


def test_comfyui_layout_loads_as_flux3s_original_format(distilled_run: Path) -> None:
    saved = distilled_run / "saved" / "final"
    comfy = saved / "adapter_model.comfyui.safetensors"
    keys = load_file(str(comfy))
    assert "diffusion_model.single_blocks.0.q_proj.lora_A.weight" in keys
    assert "diffusion_model.content_mode_blocks.image.0.mlp_out.lora_B.weight" in keys
    pipe = modular_pipeline(distilled_run.parent.parent / "model", distilled=True)
    untrained = runs.outputs(pipe.transformer, transformer_inputs(True))
    with runs.library_warnings() as warnings:
        pipe.load_lora_weights(str(saved), weight_name=comfy.name, adapter_name="trained")
    assert not [m for m in warnings if "unexpected" in m.lower() or "missing" in m.lower()], warnings
    expected = runs.outputs(reference(distilled_run, saved), transformer_inputs(True))
    runs.assert_reproduces(runs.outputs(pipe.transformer, transformer_inputs(True)), expected, untrained)
