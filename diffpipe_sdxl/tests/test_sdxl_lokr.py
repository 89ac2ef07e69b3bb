"""LoKr and LoHa on SDXL (issue 26), without training: the kohya file the core writes (``lora_unet_<SGM module>``
keys), applied the way ComfyUI applies it (:mod:`diffpipe_core.testing.comfy` with ComfyUI's SDXL key map, built
below as ``model_lora_keys_unet`` builds it from the checkpoint's keys), gives the weights the peft-adapted UNet
computes with; diffusers' ``load_lora_adapter`` loads the LoKr diffusers file to the same outputs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file

from diffpipe_core.adapter_kinds import peft_config
from diffpipe_core.adapters import adapter_state_dict, apply_adapter
from diffpipe_core.engine.saving import write_adapter
from diffpipe_core.registry import get_registry
from diffpipe_core.testing.comfy import apply_file, merged_weights
from diffpipe_sdxl.plugin import LORA_TARGETS
from diffpipe_sdxl.sgm import unet_table


def comfy_sdxl_key_map(sgm_keys: list[str]) -> dict[str, str]:
    """ComfyUI's kohya keys for an SGM checkpoint: ``lora_unet_<module, dots as _>`` for every
    ``diffusion_model.<module>.weight`` (``model_lora_keys_unet``)."""
    weights = [k.removeprefix("model.") for k in sgm_keys if k.endswith(".weight")]
    return {"lora_unet_" + k[len("diffusion_model.") : -len(".weight")].replace(".", "_"): k for k in weights}


def adapted(unet_dir: Path, kind: str, **options):
    unet = UNet2DConditionModel.from_pretrained(unet_dir, subfolder="unet", local_files_only=True)
    base = copy.deepcopy(unet)
    config = peft_config(kind, options.pop("rank", 2), 5.0, LORA_TARGETS, **options)
    apply_adapter(unet, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in unet.parameters():
            if p.requires_grad:
                p.normal_(std=0.2)
    return unet.eval(), base.eval(), config


def sgm(state: dict[str, torch.Tensor], unet: UNet2DConditionModel) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in unet_table(unet.config).to_original(state).items()}


@pytest.mark.parametrize("kind, options", [("lokr", {"factor": 4}), ("lokr", {"rank": 64}), ("loha", {})])
def test_kohya_file_applies_like_the_peft_adapter(tiny_sdxl, tmp_path: Path, kind: str, options: dict) -> None:
    unet, base, config = adapted(tiny_sdxl[0], kind, **options)
    plugin = get_registry().model("sdxl")
    problems = write_adapter(tmp_path / "s", adapter_state_dict(unet), plugin, config, ["kohya"], torch.float32)
    assert problems == []
    kohya = load_file(str(tmp_path / "s" / "adapter_model.kohya.safetensors"))
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.alpha" in kohya
    base_sgm = sgm({k: v.float() for k, v in base.state_dict().items()}, base)
    got = apply_file(base_sgm, kohya, comfy_sdxl_key_map(list(base_sgm)))
    expected = sgm(merged_weights(unet), base)
    assert got.keys() == expected.keys()
    changed = sum(not torch.equal(expected[k], base_sgm[k]) for k in expected)
    assert changed == len([k for k in kohya if k.endswith(".alpha")]) > 10
    for key in expected:
        assert torch.allclose(got[key], expected[key], atol=1e-5), key


def test_lokr_diffusers_file_loads_in_diffusers_to_the_trained_outputs(tiny_sdxl, tmp_path: Path) -> None:
    unet, base, config = adapted(tiny_sdxl[0], "lokr", factor=4)
    write_adapter(tmp_path / "s", adapter_state_dict(unet), get_registry().model("sdxl"), config, [], torch.float32)
    assert all(k.startswith("unet.") for k in load_file(str(tmp_path / "s" / "adapter_model.safetensors")))
    base.load_lora_adapter(str(tmp_path / "s"), weight_name="adapter_model.safetensors", prefix="unet")
    g = torch.Generator().manual_seed(0)
    x, text, pooled = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g), torch.randn(2, 32)
    cond = {"text_embeds": pooled, "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}
    with torch.no_grad():
        expected = unet(x, torch.tensor([10, 500]), text, added_cond_kwargs=cond).sample
        got = base(x, torch.tensor([10, 500]), text, added_cond_kwargs=cond).sample
    assert torch.allclose(got, expected, atol=1e-5)
