"""Ideogram 4's one shared training run (the CLI: DeepSpeed, the real cache, peft; 1 process) trains with the loss
falling and samples before its first step, saving the golden LoRA; a short 2-stage run in 2 processes from its cache
draws the same losses; both runs' guided samples (``cfg = 2.5``) equal ``Ideogram4Pipeline``'s; the saved diffusers
LoRA loads through ``Ideogram4Pipeline.load_lora_weights`` and reproduces the trained transformer; the ComfyUI file
(Ideogram's fused ``attention.qkv``) is loaded whole by ComfyUI's key map and applies like the trained LoRA, and
diffusers' own converter of that layout loads it to the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.comfy import apply_file, generic_key_map, merged_weights
from diffpipe_core.testing.golden import assert_matches
from diffpipe_ideogram.original import layout_for_config
from diffpipe_ideogram.testing import comfy_path, load_pipeline, write_tiny_ideogram4

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, TWO_STAGE_STEPS = 4, 8.0, 12, 4
SAMPLE = {"prompts": ["a red cat"], "cfg": 2.5, "steps": 2, "before_first_step": True}
GOLDEN = Path(__file__).parent / "golden"


def run_config(steps: int, stages: int = 1, sample: dict | None = SAMPLE, **top: object) -> str:
    model = {"type": "ideogram4", "text_max_length": 32, "timestep_sample_method": "uniform"}
    top = {"max_steps": steps, "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3, **top}
    return runs.lora_run_toml(model, 5e-2, sample, RANK, ALPHA, **top)


@pytest.fixture(scope="module")
def ideogram4_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared training run of ``ideogram4`` through the CLI (1 process): a tiny model, 4 captioned 32x32
    images, LoRA saved as diffusers and ComfyUI files, a sample before the first step. Its run folder."""
    return runs.image_run(tmp_path_factory.mktemp("ideogram4-train"), write_tiny_ideogram4, run_config(STEPS))


@pytest.fixture(scope="module")
def ideogram4_two_stages(ideogram4_run: Path) -> Path:
    """The same project on 2 pipeline stages in 2 processes, 4 steps from the 1-process run's cache, the same sample
    before its first step (the unconditional transformer on the last stage, its predictions broadcast)."""
    return runs.stages_run(ideogram4_run, run_config(TWO_STAGE_STEPS, 2, partition_split=[2]))


def test_trains_on_two_stages_as_on_one(ideogram4_two_stages: Path, ideogram4_run: Path) -> None:
    runs.assert_stages_train_as_one(ideogram4_two_stages, ideogram4_run, TWO_STAGE_STEPS)


def test_the_loss_falls_a_sample_is_written_and_the_lora_is_golden(ideogram4_run: Path) -> None:
    runs.assert_loss_falls(ideogram4_run, STEPS, 4)
    names = sorted(p.name for p in (ideogram4_run / "samples" / "step-0000000").iterdir())
    assert "00-a-red-cat.png" in names, names
    assert_matches(ideogram4_run / "saved" / "final", GOLDEN / "ideogram4.json")


def test_guided_samples_before_training_equal_the_pipeline(ideogram4_run: Path, ideogram4_two_stages: Path) -> None:
    """The runs' samples at step 0 (LoRA B = 0: the base model) at ``cfg = 2.5``, on 1 and on 2 stages, equal
    ``Ideogram4Pipeline(guidance_scale=2.5)``'s latents for the sample's seed (its unconditional transformer)."""
    from diffpipe_core.sampling.loop import noise_generator
    from diffpipe_ideogram.plugin import untokens

    with torch.no_grad():
        want = load_pipeline(ideogram4_run.parent.parent / "model")(
            prompt=SAMPLE["prompts"][0], height=32, width=32, num_inference_steps=SAMPLE["steps"],
            max_sequence_length=32, guidance_scale=SAMPLE["cfg"], guidance_schedule=None, output_type="latent",
            generator=noise_generator(0, 0)).images
    for run in (ideogram4_run, ideogram4_two_stages):
        got = load_file(str(run / "samples" / "step-0000000" / "latents.safetensors"))["sample_00"]
        torch.testing.assert_close(got, untokens(want, 2, 2), rtol=1e-4, atol=1e-5)


def transformer_inputs(seed: int = 0) -> dict:
    from diffusers import Ideogram4Pipeline

    g = torch.Generator().manual_seed(seed)
    pos, seg, ind = Ideogram4Pipeline._prepare_ids([6, 3], 2, 2, 6, torch.device("cpu"))
    features = torch.randn(2, 10, 13 * 32, generator=g) * (ind == 3)[..., None]
    return {"hidden_states": torch.randn(2, 10, 16, generator=g), "encoder_hidden_states": features,
            "timestep": torch.rand(2, generator=g), "position_ids": pos, "segment_ids": seg, "indicator": ind}


def test_diffusers_lora_loads_in_the_pipeline_and_reproduces(ideogram4_run: Path) -> None:
    from diffusers import Ideogram4Transformer2DModel

    model_dir, saved = ideogram4_run.parent.parent / "model", ideogram4_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding=(
        "layers.1.attention.to_q.lora_A.weight", "layers.0.feed_forward.w3.lora_B.weight",
        "layers.1.adaln_modulation.lora_A.weight"))
    reference = runs.with_trained_lora(
        Ideogram4Transformer2DModel.from_pretrained(str(model_dir / "transformer")), ideogram4_run, RANK, ALPHA,
        cfg["target_modules"],
    )
    pipe = load_pipeline(model_dir)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(), ALPHA)


def test_comfyui_lora_is_loaded_whole_by_comfyuis_key_map(ideogram4_run: Path) -> None:
    """ComfyUI's key map for Ideogram 4 (``comfy/lora.py``'s generic ``diffusion_model.<module>`` entry of each weight
    of its native model, ``comfy/ldm/ideogram4``: fused ``attention.qkv``) applies every tensor of the ComfyUI file;
    diffusers' own converter of that layout (ai-toolkit's) reads it to the same weights."""
    from diffusers import Ideogram4Pipeline

    model_dir = ideogram4_run.parent.parent / "model"
    comfy = load_file(str(ideogram4_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    assert "diffusion_model.layers.0.attention.qkv.lora_A.weight" in comfy
    assert "diffusion_model.layers.1.feed_forward.w2.lora_B.weight" in comfy
    base = load_file(str(comfy_path(model_dir)))
    native = {k.removeprefix("model.diffusion_model."): v for k, v in base.items()}
    got = apply_file({f"diffusion_model.{k}": v for k, v in native.items()}, comfy, generic_key_map(native))
    table = layout_for_config(load_pipeline(model_dir).transformer.config)
    got = table.to_model({k.removeprefix("diffusion_model."): v for k, v in got.items()})
    weights = table.to_model(dict(native))
    params = runs.checkpoint_params(ideogram4_run)
    runs.assert_state_close(got, runs.merge_peft(weights, params, ALPHA / RANK), atol=1e-5)
    # diffusers converts the same file (Ideogram4LoraLoaderMixin.lora_state_dict): one A per fused qkv, B in thirds
    converted = Ideogram4Pipeline.lora_state_dict(dict(comfy))
    assert "transformer.layers.0.attention.to_k.lora_B.weight" in converted
    pipe = load_pipeline(model_dir)
    pipe.load_lora_weights(dict(comfy), adapter_name="comfy")
    runs.assert_state_close(merged_weights(pipe.transformer, "comfy"), runs.merge_peft(weights, params, ALPHA / RANK),
                            atol=1e-5)
