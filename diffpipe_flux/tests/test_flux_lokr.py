"""LoKr and LoHa on Flux (issue 26), without training: the ComfyUI file the core writes, applied the way ComfyUI
applies it (:mod:`diffpipe_core.testing.comfy`: its formulas, and its Flux key map below), gives the weights the
peft-adapted model computes with; diffusers' ``load_lora_adapter`` loads the LoKr diffusers file to the same
outputs. The trained, resumed run is in test_flux_lokr_train.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.adapter_kinds import peft_config
from diffpipe_core.adapters import adapter_state_dict, apply_adapter, read_adapter
from diffpipe_core.engine.saving import write_adapter
from diffpipe_core.registry import get_registry
from diffpipe_core.testing.comfy import KeyTarget, apply_file, merged_weights
from diffpipe_flux.bfl import bfl_to_diffusers, diffusers_to_bfl
from diffpipe_flux.testing import TinyFluxConfig, tiny_transformer, transformer_inputs

TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_v_proj", "attn.to_out.0", "proj_mlp",
    "ff.net.2", "norm_out.linear", "x_embedder",
]  # fmt: skip


def swap_scale_shift(weight: torch.Tensor) -> torch.Tensor:
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def comfy_flux_key_map(num_double: int, num_single: int, hidden: int) -> dict[str, KeyTarget]:
    """ComfyUI's ``transformer.<diffusers module>`` keys for Flux (``model_lora_keys_unet`` over
    ``comfy.utils.flux_to_diffusers``), onto BFL weight names: (weight, (dim, start, length), function)."""
    out: dict[str, KeyTarget] = {}
    for i in range(num_double):
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for j, (img, txt) in enumerate((("to_q", "add_q_proj"), ("to_k", "add_k_proj"), ("to_v", "add_v_proj"))):
            out[f"{d}.attn.{img}"] = (f"{b}.img_attn.qkv.weight", (0, j * hidden, hidden), None)
            out[f"{d}.attn.{txt}"] = (f"{b}.txt_attn.qkv.weight", (0, j * hidden, hidden), None)
        renames = {
            "attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
            "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
            "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
        }  # fmt: skip
        out |= {f"{d}.{k}": f"{b}.{v}.weight" for k, v in renames.items()}
    for i in range(num_single):
        d, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for j, name in enumerate(("to_q", "to_k", "to_v")):
            out[f"{d}.attn.{name}"] = (f"{b}.linear1.weight", (0, j * hidden, hidden), None)
        out[f"{d}.proj_mlp"] = (f"{b}.linear1.weight", (0, 3 * hidden, 4 * hidden), None)
        out |= {f"{d}.norm.linear": f"{b}.modulation.lin.weight", f"{d}.proj_out": f"{b}.linear2.weight"}
    tte = "time_text_embed"
    basic = {
        "proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
        f"{tte}.timestep_embedder.linear_1": "time_in.in_layer",
        f"{tte}.timestep_embedder.linear_2": "time_in.out_layer",
        f"{tte}.text_embedder.linear_1": "vector_in.in_layer", f"{tte}.text_embedder.linear_2": "vector_in.out_layer",
        f"{tte}.guidance_embedder.linear_1": "guidance_in.in_layer",
        f"{tte}.guidance_embedder.linear_2": "guidance_in.out_layer",
    }  # fmt: skip
    out |= {k: f"{v}.weight" for k, v in basic.items()}
    out["norm_out.linear"] = ("final_layer.adaLN_modulation.1.weight", None, swap_scale_shift)
    return {f"transformer.{k}": v for k, v in out.items()}


def adapted(kind: str, **options):
    torch.manual_seed(1)
    model = tiny_transformer(TinyFluxConfig())
    base = copy.deepcopy(model)
    config = peft_config(kind, options.pop("rank", 2), 3.0, TARGETS, **options)
    apply_adapter(model, config)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.2)  # "trained": every factor nonzero
    return model.eval(), base.eval(), config


CASES = {
    "lokr": ("lokr", {"factor": 4}),  # w1 whole (4 x 4), w2 = w2_a @ w2_b (rank 2)
    "lokr_whole": ("lokr", {"rank": 16}),  # both factors whole: ComfyUI ignores alpha, the export folds it in
    "lokr_both": ("lokr", {"factor": 8, "decompose_both": True, "rank": 1}),
    "loha": ("loha", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_comfyui_file_applies_like_the_peft_adapter(case: str, tmp_path: Path) -> None:
    kind, options = CASES[case]
    model, base, config = adapted(kind, **options)
    state = adapter_state_dict(model)
    whole = sum(k.endswith(".lokr_w1") for k in state), sum(k.endswith(".lokr_w2") for k in state)
    if case == "lokr_whole":
        assert whole[0] == whole[1] > 0
    elif case == "lokr_both":
        assert any(k.endswith(".lokr_w1_a") for k in state)
    flux = get_registry().model("flux")
    problems = write_adapter(tmp_path / "saved", state, flux, config, ["comfyui"], torch.float32)
    assert problems == []
    comfy = load_file(str(tmp_path / "saved" / "adapter_model.comfyui.safetensors"))
    assert "transformer.transformer_blocks.0.attn.to_q.alpha" in comfy
    bfl = diffusers_to_bfl({k: v.float() for k, v in base.state_dict().items()})
    got = bfl_to_diffusers(apply_file(bfl, comfy, comfy_flux_key_map(2, 2, 32)))
    expected = merged_weights(model)
    assert got.keys() == expected.keys()
    changed = 0
    for key, value in expected.items():
        assert torch.allclose(got[key], value, atol=1e-5), key
        changed += not torch.equal(value, base.state_dict()[key].float())
    assert changed >= 10, "the adapter changed too few weights for the check to mean much"


def test_lokr_diffusers_file_loads_in_diffusers_to_the_trained_outputs(tmp_path: Path) -> None:
    model, base, config = adapted("lokr", factor=4)
    write_adapter(
        tmp_path / "saved", adapter_state_dict(model), get_registry().model("flux"), config, [], torch.float32
    )
    saved, cfg = read_adapter(tmp_path / "saved")
    assert cfg["peft_type"] == "LOKR" and cfg["decompose_factor"] == 4 and cfg["alpha"] == 2.0  # 3 folded in
    assert all(k.startswith("transformer.") for k in saved) and not any(k.endswith(".alpha") for k in saved)
    # the pipelines' load_lora_weights take LoRA keys only; the model's load_lora_adapter reads a peft LoKr and,
    # from the file's metadata, its alpha and factor
    base.load_lora_adapter(str(tmp_path / "saved"), weight_name="adapter_model.safetensors", prefix="transformer")
    inputs = transformer_inputs()
    with torch.no_grad():
        expected, got = model(**inputs).sample, base(**inputs).sample
    assert (expected - tiny_transformer(TinyFluxConfig())(**inputs).sample).abs().max() > 1e-3
    assert torch.allclose(got, expected, atol=1e-5)


def test_a_module_comfyui_has_no_name_for_is_reported(tmp_path: Path) -> None:
    model = tiny_transformer(TinyFluxConfig())
    config = peft_config("lokr", 2, 2.0, ["x_embedder"])
    apply_adapter(model, config)
    state = {k.replace("x_embedder", "pos_embed.proj"): v for k, v in adapter_state_dict(model).items()}
    problems = write_adapter(tmp_path / "s", state, get_registry().model("flux"), config, ["comfyui"], torch.float32)
    assert len(problems) == 1 and "pos_embed.proj" in problems[0] and "'comfyui' not written" in problems[0]
    assert (tmp_path / "s" / "adapter_model.safetensors").is_file()


def test_key_names_hook() -> None:
    from diffpipe_flux.plugin import plugin as flux

    modules = ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.1.proj_mlp", "norm_out.linear"]
    assert flux.adapter_key_names(modules=modules, format="comfyui") == {m: f"transformer.{m}" for m in modules}
    assert flux.adapter_key_names(modules=modules, format="diffusers") is None
    with pytest.raises(ValueError, match="transformer_blocks.0.attn.norm_q"):
        flux.adapter_key_names(modules=["transformer_blocks.0.attn.norm_q"], format="comfyui")
