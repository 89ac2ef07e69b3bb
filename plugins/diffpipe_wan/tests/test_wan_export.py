"""Exports without training, and the training-time settings: the ComfyUI LoRA has exactly the keys ComfyUI's key map
builds for a Wan model (``diffusion_model.<original module>``, ``.alpha`` included) and applies to the original
weights like the separate LoRAs (text-to-video and image-to-video modules); full fine-tunes written as a diffusers
folder or an original-layout single file load back to the same weights; the A14B expert's time range and the
folder scheduler's shift, unless ``min_t`` / ``max_t`` / ``shift`` are given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core import TrainingContext
from diffpipe_core.adapters import apply_lora, lora_config, lora_state_dict
from diffpipe_core.schema import validate
from diffpipe_core.testing import comfy, runs
from diffpipe_wan.original import layout
from diffpipe_wan.plugin import wan
from diffpipe_wan.testing import TinyWanConfig, tiny_transformer

CPU = torch.device("cpu")


def config(path: Path, **kw):
    table = {"type": "wan", "path": path, "dtype": "float32", "encoder_dtype": "float32", **kw}
    return validate(wan.spec.config_schema, table, "test")


def test_comfyui_lora_keys_are_comfyuis_and_apply_like_the_separate_loras() -> None:
    model = tiny_transformer(TinyWanConfig(i2v=True, clip=True))
    targets = wan.lora_targets(model_config=None)
    runs.with_random_lora(model, targets)
    state = lora_state_dict(model)
    file = wan.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    original = layout(2).to_original(base)  # the model as ComfyUI holds it (its Wan model has these names)
    key_map = comfy.generic_key_map(original)  # ComfyUI adds no Wan-specific entries
    per_block = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k")
    per_block += ("cross_attn.v", "cross_attn.o", "cross_attn.k_img", "cross_attn.v_img", "ffn.0", "ffn.2")
    modules = {f"diffusion_model.blocks.{i}.{m}" for i in range(2) for m in per_block}
    assert set(file) == {f"{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert modules <= set(key_map) and all(float(file[f"{m}.alpha"]) == 6.0 for m in modules)
    held = {f"diffusion_model.{k}": v for k, v in original.items()}  # ComfyUI's model state dict: under the prefix
    applied = comfy.apply_file(held, file, key_map)
    got = layout(2).to_model({k.removeprefix("diffusion_model."): v for k, v in applied.items()})
    expected = comfy.merged_weights(model)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6)
    assert wan.export_adapter(state_dict=state, alpha=6.0, rank=4, format="kohya") is None
    assert set(wan.export_adapter(state_dict=state, alpha=6.0, rank=4, format="diffusers")) == {
        f"transformer.{k}" for k in state
    }


def test_full_model_exports_load_back(tiny_wan_a14b: Path, tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    cfg = config(tiny_wan_a14b, expert="low")
    model = wan.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        model.blocks[1].ffn.net[2].weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(wan, model, cfg, saved)
    assert wan.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / "x", format="ckpt") is None
    single = saved / "single_file" / "wan_transformer.safetensors"
    assert "blocks.1.ffn.2.weight" in load_file(str(single))
    from_single = wan.load_diffusion_model(
        config(tiny_wan_a14b, expert="low", diffusion_model=single), CPU, torch.float32
    ).state_dict()
    from_folder = WanTransformer3DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single[key], value), key
        assert torch.equal(from_folder[key], value), key


def times(cfg, n: int = 400) -> torch.Tensor:
    batch = {"latents": torch.zeros(n, 4, 1, 2, 2), "text_embeds": torch.zeros(n, 1, 32)}
    (_, t, _), _ = wan.prepare_inputs(
        batch=batch, context=TrainingContext(cfg), generator=torch.Generator().manual_seed(0)
    )
    return t


@pytest.mark.parametrize(
    ("keys", "low", "high"),
    [
        ({"expert": "high"}, 0.875, 1.0),
        ({"expert": "low"}, 0.0, 0.875),
        ({"expert": "low", "min_t": 0.2}, 0.2, 0.875),
        ({"expert": "high", "max_t": 0.95}, 0.875, 0.95),
    ],
)
def test_an_expert_trains_only_its_times_unless_min_t_max_t_are_given(tiny_wan_a14b: Path, keys, low, high) -> None:
    t = times(config(tiny_wan_a14b, timestep_sample_method="uniform", **keys))
    assert t.min() >= low and t.max() <= high
    assert t.min() < low + 0.02 * (high - low) and t.max() > high - 0.02 * (high - low)  # and all of it


def test_shift_is_the_folder_schedulers_unless_given(tiny_wan: Path) -> None:
    from diffpipe_core.diffusion import shift_timesteps

    assert wan.flow_settings(config(tiny_wan))[0] == 5.0  # the tiny folder's FlowMatchEulerDiscreteScheduler(shift=5)
    assert wan.flow_settings(config(tiny_wan, shift=3.0))[0] == 3.0
    u = times(config(tiny_wan, timestep_sample_method="uniform", shift=1.0))
    torch.testing.assert_close(times(config(tiny_wan, timestep_sample_method="uniform")), shift_timesteps(u, 5.0))


def test_a_low_expert_lora_loads_into_transformer_2_of_wan_pipeline(tiny_wan_a14b: Path, tmp_path: Path) -> None:
    """What the README says for an A14B ``expert = "low"`` LoRA: ``WanPipeline.load_lora_weights(...,
    load_into_transformer_2=True)`` puts it on the low-noise expert, at the saved strength, the other one untouched."""
    from diffusers import WanPipeline

    from diffpipe_core.adapters import save_adapter
    from diffpipe_core.testing import runs

    cfg = config(tiny_wan_a14b, expert="low")
    model = wan.load_diffusion_model(cfg, CPU, torch.float32)
    peft_cfg = lora_config(4, 6.0, 0.0, wan.lora_targets(model_config=cfg))
    apply_lora(model, peft_cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.1)
    files = {
        "adapter_model.safetensors": wan.export_adapter(
            state_dict=lora_state_dict(model), alpha=6.0, rank=4, format="diffusers"
        )
    }
    save_adapter(tmp_path, files, peft_cfg, torch.float32, "transformer")  # as a run saves it

    pipe = WanPipeline.from_pretrained(str(tiny_wan_a14b), local_files_only=True)
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0)),
        "timestep": torch.tensor([300.0]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1)),
    }
    untrained, high = runs.outputs(pipe.transformer_2, inputs), runs.outputs(pipe.transformer, inputs)
    pipe.load_lora_weights(str(tmp_path), weight_name="adapter_model.safetensors", load_into_transformer_2=True)
    runs.assert_reproduces(runs.outputs(pipe.transformer_2, inputs), runs.outputs(model.eval(), inputs), untrained)
    assert torch.equal(runs.outputs(pipe.transformer, inputs), high)  # the high-noise expert has no LoRA
