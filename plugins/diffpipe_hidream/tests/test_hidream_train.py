"""End to end through the real CLI (DeepSpeed on gloo, the real cache, peft), on the one shared run (conftest's
``hidream_run``): the loss falls; the same project on 2 pipeline stages in 2 processes (the MoE blocks split over
them like any block) draws the same losses; the saved diffusers LoRA loads through
HiDreamImagePipeline.load_lora_weights and reproduces the trained transformer; the ComfyUI file holds exactly the
module names ComfyUI's HiDream key map accepts, with alpha, and applies to the ComfyUI file's weights like the
trained LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import lora_project, runs
from diffpipe_hidream.testing import PREFIX, comfy_path, write_tiny_hidream

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, TWO_STAGE_STEPS = 4, 8.0, 16, 4
MODEL = {"type": "hidream", "text_max_length": 16, "shift": 1.0}


def run_config(model: dict = MODEL, **top: object) -> str:
    """The project's run config: 1 process, micro-batches of 4, ``STEPS`` steps; ``top`` changes the top-level keys."""
    return lora_project.run_config(model, 1e-2, STEPS, RANK, ALPHA, **top)


def make_project(root: Path, tiny: Path | None = None) -> Path:
    """The tiny model (a copy of the session's ``tiny`` folder and its ComfyUI file, when given), 4 captioned 32x32
    images and ``run.toml`` in ``root``."""
    write = write_tiny_hidream if tiny is None else lora_project.copy_of(tiny, comfy_path)
    return lora_project.make_project(root, write, run_config())


def transformer_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(2, 4, 4, 4, generator=g),
        "timesteps": torch.rand(2, generator=g) * 1000,
        "encoder_hidden_states_t5": torch.randn(2, 16, 32, generator=g),
        "encoder_hidden_states_llama3": torch.randn(3, 2, 16, 24, generator=g),
        "pooled_embeds": torch.randn(2, 48, generator=g),
    }


def test_loss_falls(hidream_run: Path) -> None:
    runs.assert_loss_falls(hidream_run, STEPS, window=4)
    assert runs.stage_files(hidream_run) == ["params-stage0.safetensors"]
    # every target trained (lora_B starts at zero): the routed experts too, so the MoE took its training path
    saved = load_file(str(hidream_run / "saved" / "final" / "adapter_model.safetensors"))
    untrained = [k for k, v in saved.items() if "lora_B" in k and not v.any()]
    assert any(".ff_i.experts.3." in k for k in saved) and not untrained, untrained[:3]


def test_trains_on_two_stages_as_on_one(hidream_run: Path) -> None:
    """3 layers per stage: the embedding and double-stream blocks on one, the single-stream blocks and the head on
    the other; the Llama stack and the text stream cross the boundary."""
    model = {**MODEL, "path": "model"}
    config = run_config(model, pipeline_stages=2, max_steps=TWO_STAGE_STEPS, checkpoint_every_n_steps=TWO_STAGE_STEPS,
                        partition_split=[3])
    staged = runs.stages_run(hidream_run, config)
    runs.assert_stages_train_as_one(staged, hidream_run, TWO_STAGE_STEPS)


def test_diffusers_lora_loads_in_the_pipeline_and_reproduces(hidream_run: Path) -> None:
    from diffusers import HiDreamImagePipeline, HiDreamImageTransformer2DModel

    model_dir, saved = hidream_run.parent.parent / "model", hidream_run / "saved" / "final"
    holding = ("double_stream_blocks.0.block.attn1.to_q_t.lora_B.weight",
               "single_stream_blocks.1.block.ff_i.experts.0.w1.lora_A.weight",
               "double_stream_blocks.1.block.ff_t.w2.lora_A.weight")
    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding)
    trained = ("double_stream_blocks.0.block.ff_i.shared_experts.w3", "single_stream_blocks.0.block.attn1.to_out")
    reference = runs.trained_transformer(HiDreamImageTransformer2DModel, hidream_run, model_dir, RANK, ALPHA,
                                         cfg["target_modules"], trained)
    pipe = HiDreamImagePipeline.from_pretrained(str(model_dir), local_files_only=True)
    # alpha != rank, so reproducing the outputs also proves diffusers applied the trained strength
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(), ALPHA)


def test_comfyui_lora_keys_and_weights(hidream_run: Path) -> None:
    model_dir = hidream_run.parent.parent / "model"
    native = {k.removeprefix(PREFIX): v for k, v in load_file(str(comfy_path(model_dir))).items()}
    # ComfyUI's model_lora_keys_unet on its HiDream (diffusers' module names)
    to_model = lambda state: {k.removeprefix("diffusion_model."): v for k, v in state.items()}  # noqa: E731
    file, stems = lora_project.assert_comfyui_file_applies(hidream_run, native, to_model, RANK, ALPHA)
    assert "diffusion_model.single_stream_blocks.1.block.ff_i.experts.3.w2" in stems
    # the trained alpha / rank is folded into lora_B, as in the diffusers file: alpha = rank
    assert float(file["diffusion_model.double_stream_blocks.0.block.attn1.to_q.alpha"]) == RANK
