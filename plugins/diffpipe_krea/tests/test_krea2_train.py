"""Krea 2's one shared training run (the CLI: DeepSpeed, the real cache, peft; 1 process, LoRA on the text layers too)
trains with the loss falling and samples before its first step, saving the golden LoRA; a short 2-stage run in 2
processes from its cache draws the same losses; the saved diffusers LoRA loads through
``Krea2Pipeline.load_lora_weights`` and reproduces the trained transformer; the ComfyUI file is loaded whole by
ComfyUI's Krea 2 key map and applies like the trained LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.comfy import KeyTarget, apply_file, generic_key_map
from diffpipe_core.testing.golden import assert_matches
from diffpipe_krea.testing import comfy_path, load_pipeline, write_tiny_krea2

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, TWO_STAGE_STEPS = 4, 8.0, 20, 5
SAMPLE = {"prompts": ["a red cat"], "negative_prompt": "blurry", "cfg": 3.0, "steps": 2, "before_first_step": True}
GOLDEN = Path(__file__).parent / "golden"


def run_config(steps: int, stages: int = 1, sample: dict | None = SAMPLE, **top: object) -> str:
    model = {"type": "krea2", "text_max_length": 16, "timestep_sample_method": "uniform"}
    top = {"max_steps": steps, "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3, **top}
    return runs.lora_run_toml(model, 5e-2, sample, RANK, ALPHA, **top)


@pytest.fixture(scope="module")
def krea2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared training run of ``krea2`` through the CLI (1 process): a tiny model, 4 captioned 32x32 images,
    LoRA saved as diffusers and ComfyUI files, a CFG sample before the first step. Its run folder."""
    return runs.image_run(tmp_path_factory.mktemp("krea2-train"), write_tiny_krea2, run_config(STEPS))


@pytest.fixture(scope="module")
def krea2_two_stages(krea2_run: Path) -> Path:
    """The same project on 2 pipeline stages in 2 processes, 5 steps from the 1-process run's cache, no samples."""
    return runs.stages_run(krea2_run, run_config(TWO_STAGE_STEPS, 2, None, partition_split=[2]))


def test_trains_on_two_stages_as_on_one(krea2_two_stages: Path, krea2_run: Path) -> None:
    runs.assert_stages_train_as_one(krea2_two_stages, krea2_run, TWO_STAGE_STEPS)


def test_the_loss_falls_a_sample_is_written_and_the_lora_is_golden(krea2_run: Path) -> None:
    runs.assert_loss_falls(krea2_run, STEPS, 5)
    names = sorted(p.name for p in (krea2_run / "samples" / "step-0000000").iterdir())
    assert "00-a-red-cat.png" in names, names
    assert_matches(krea2_run / "saved" / "final", GOLDEN / "krea2.json")


def transformer_inputs(seed: int = 0) -> dict:
    from diffusers import Krea2Pipeline

    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 2:4] = False
    return {
        "hidden_states": torch.randn(2, 4, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 6, 12, 32, generator=g),
        "encoder_attention_mask": mask,
        "timestep": torch.rand(2, generator=g),
        "position_ids": Krea2Pipeline.prepare_position_ids(6, 2, 2, torch.device("cpu")),
    }


def test_diffusers_lora_loads_in_the_pipeline_and_reproduces(krea2_run: Path) -> None:
    from diffusers import Krea2Transformer2DModel

    model_dir, saved = krea2_run.parent.parent / "model", krea2_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding=(
        "transformer_blocks.1.ff.down.lora_A.weight", "text_fusion.refiner_blocks.0.attn.to_gate.lora_B.weight",
        "text_fusion.projector.lora_A.weight", "txt_in.linear_2.lora_B.weight"))
    reference = runs.with_trained_lora(
        Krea2Transformer2DModel.from_pretrained(str(model_dir / "transformer")), krea2_run, RANK, ALPHA,
        cfg["target_modules"],
    )
    pipe = load_pipeline(model_dir)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(), ALPHA)


def comfy_krea2_key_map(native: dict[str, torch.Tensor]) -> dict[str, KeyTarget]:
    """ComfyUI's LoRA key map of a Krea 2 model (``comfy/lora.py`` ``model_lora_keys_unet``: the generic
    ``diffusion_model.<module>`` of every weight of its native state dict, and its ``Krea2`` branch, which maps the
    diffusers names of ``comfy.utils.krea2_to_diffusers``'s linears, bare and under ``diffusion_model.`` and
    ``transformer.``, onto the native weights). Which native weight a diffusers name is comes from diffusers' own
    conversion, so the key map does not lean on this plugin's table."""
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    out = generic_key_map(native)
    linears = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up", "ff.down")
    basic = ("img_in", "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj", "txt_in.linear_1",
             "txt_in.linear_2", "text_fusion.projector", "final_layer.linear")
    for key in native:
        (name,) = convert_krea2_transformer_checkpoint_to_diffusers({key: native[key]})
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and (module in basic or module.endswith(linears)):
            for stem in (module, f"diffusion_model.{module}", f"transformer.{module}"):
                out[stem] = f"diffusion_model.{key}"
    return out


def test_comfyui_lora_is_loaded_whole_by_comfyuis_key_map(krea2_run: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    comfy = load_file(str(krea2_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    assert "diffusion_model.blocks.0.attn.wq.lora_A.weight" in comfy
    assert "diffusion_model.txtfusion.layerwise_blocks.1.mlp.up.lora_B.weight" in comfy
    base = load_file(str(comfy_path(krea2_run.parent.parent / "model")))
    native = {k.removeprefix("model.diffusion_model."): v for k, v in base.items()}
    got = apply_file({f"diffusion_model.{k}": v for k, v in native.items()}, comfy, comfy_krea2_key_map(native))
    got = convert_krea2_transformer_checkpoint_to_diffusers({k.removeprefix("diffusion_model."): v
                                                            for k, v in got.items()})
    weights = convert_krea2_transformer_checkpoint_to_diffusers(dict(native))
    params = runs.checkpoint_params(krea2_run)
    runs.assert_state_close(got, runs.merge_peft(weights, params, ALPHA / RANK), atol=1e-5)
    modules = {k.split(".lora_A.")[0] for k in params if ".lora_A." in k}
    assert sum(not torch.equal(got[k], weights[k]) for k in weights) == len(modules)


def test_the_comfyui_lora_merges_as_a_training_adapter(krea2_run: Path) -> None:
    """``[model] merge_adapters`` (how Turbo trains over a de-distilling adapter) places a LoRA in Krea's ComfyUI
    names through this plugin's key table: merged at weight 1 it gives the trained weights."""
    from types import SimpleNamespace

    from diffusers import Krea2Transformer2DModel

    from diffpipe_core.merge_adapters import merge_into, native_targets
    from diffpipe_core.schema import validate
    from diffpipe_core.testing.sampling import registered
    from diffpipe_krea.config import Krea2Config
    from diffpipe_krea.plugin import plugin

    model_dir = krea2_run.parent.parent / "model"
    cfg = validate(Krea2Config, {"type": "krea2", "path": model_dir, "dtype": "float32"}, "test")
    model = Krea2Transformer2DModel.from_pretrained(str(model_dir / "transformer"))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    entry = SimpleNamespace(path=krea2_run / "saved" / "final" / "adapter_model.comfyui.safetensors", weight=1.0)
    params = runs.checkpoint_params(krea2_run)
    added = merge_into(model, [entry], "transformer", native_targets(registered(plugin, "krea2"), cfg))
    assert added == len({k.split(".lora_A.")[0] for k in params if ".lora_A." in k})
    runs.assert_state_close(model.state_dict(), runs.merge_peft(base, params, ALPHA / RANK), atol=1e-5)
