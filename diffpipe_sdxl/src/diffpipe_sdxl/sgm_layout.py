"""diffusers names -> the original SGM (Stability generative-models) names that single-file SDXL checkpoints,
ComfyUI, A1111 and kohya use.

diffusers converts SGM -> diffusers when it loads a single file (``from_single_file``); this module is the
other direction, for writing original-layout checkpoints and kohya LoRA keys. The tests check it against
diffusers' own converter: a checkpoint written here loads back through ``from_single_file`` to the same
weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
CLIP_G_PREFIX = "conditioner.embedders.1.model."

#: every SDXL checkpoint (base, refiner, fine-tunes) has two layers per down block
SDXL_LAYERS_PER_BLOCK = 2

_UNET_SIMPLE = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


@dataclass(frozen=True)
class UNetLayout:
    """What the UNet name mapping needs from the config: layers per down block, and which up blocks have
    attentions (their upsampler sits at index 2 of the SGM output block instead of 1)."""

    layers_per_block: int = SDXL_LAYERS_PER_BLOCK
    up_has_attention: tuple[bool, ...] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> UNetLayout:
        lpb = config["layers_per_block"]
        if not isinstance(lpb, int):
            raise ValueError(f"UNet config layers_per_block={lpb!r}: only one value for every block is supported")
        return cls(lpb, tuple("CrossAttn" in t for t in config["up_block_types"]))


def _resnet_rest(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{_RESNET.get(head, head)}.{tail}" if tail else _RESNET.get(head, head)


def unet_name_to_sgm(name: str, layout: UNetLayout = UNetLayout()) -> str:
    """A diffusers UNet parameter or module name (``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q``)
    -> its SGM name (``input_blocks.4.1.transformer_blocks.0.attn1.to_q``). Raises ValueError if unknown."""
    n = layout.layers_per_block
    for head, sgm in _UNET_SIMPLE.items():
        if name == head or name.startswith(head + "."):
            return sgm + name[len(head) :]
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", name):
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        idx = 1 + i * (n + 1) + j
        return f"input_blocks.{idx}.0.{_resnet_rest(rest)}" if kind == "resnets" else f"input_blocks.{idx}.1.{rest}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", name):
        return f"input_blocks.{1 + int(m[1]) * (n + 1) + n}.0.op.{m[2]}"
    if m := re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", name):
        return f"middle_block.{2 * int(m[1])}.{_resnet_rest(m[2])}"
    if m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", name):
        return f"middle_block.1.{m[1]}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", name):
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        idx = i * (n + 1) + j
        return f"output_blocks.{idx}.0.{_resnet_rest(rest)}" if kind == "resnets" else f"output_blocks.{idx}.1.{rest}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", name):
        i = int(m[1])
        has_attn = layout.up_has_attention[i] if layout.up_has_attention is not None else True
        return f"output_blocks.{i * (n + 1) + n}.{2 if has_attn else 1}.conv.{m[2]}"
    raise ValueError(f"no SGM name for UNet tensor {name!r}")


def unet_to_sgm(state: Mapping[str, torch.Tensor], layout: UNetLayout) -> dict[str, torch.Tensor]:
    """A diffusers UNet state dict under the single-file prefix ``model.diffusion_model.``."""
    return {UNET_PREFIX + unet_name_to_sgm(k, layout): v for k, v in state.items()}


def sgm_to_unet_names(names: list[str], layout: UNetLayout) -> dict[str, str]:
    """``{single-file key: diffusers name}`` for the given diffusers UNet names."""
    return {UNET_PREFIX + unet_name_to_sgm(k, layout): k for k in names}


# ---------------------------------------------------------------------------------------------- VAE
def _vae_name_to_ldm(name: str, num_up_blocks: int) -> str:
    for a, b in (("encoder.conv_norm_out", "encoder.norm_out"), ("decoder.conv_norm_out", "decoder.norm_out")):
        if name.startswith(a + "."):
            return b + name[len(a) :]
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", name):
        return f"encoder.down.{m[1]}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", name):
        return f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", name):
        rest = m[3].replace("conv_shortcut", "nin_shortcut")
        return f"decoder.up.{num_up_blocks - 1 - int(m[1])}.block.{m[2]}.{rest}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", name):
        return f"decoder.up.{num_up_blocks - 1 - int(m[1])}.upsample.conv.{m[2]}"
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)", name):
        return f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}"
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", name):
        rest = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
        for a, b in rest.items():
            if m[2].startswith(a + "."):
                return f"{m[1]}.mid.attn_1.{b}{m[2][len(a) :]}"
    if re.fullmatch(r"(encoder|decoder)\.conv_(in|out)\.(weight|bias)|(post_)?quant_conv\.(weight|bias)", name):
        return name
    raise ValueError(f"no original-layout name for VAE tensor {name!r}")


def vae_to_ldm(state: Mapping[str, torch.Tensor], num_up_blocks: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict in the original layout (attention projections as 1x1 convs)."""
    out = {}
    for k, v in state.items():
        name = _vae_name_to_ldm(k, num_up_blocks)
        if ".mid.attn_1." in name and name.endswith(".weight") and v.dim() == 2:
            v = v[:, :, None, None]
        out[VAE_PREFIX + name] = v
    return out


# ------------------------------------------------------------------------------------- text encoders
def clip_l_to_sgm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIPTextModel (text_encoder) -> ``conditioner.embedders.0.transformer.text_model.*``."""
    return {CLIP_L_PREFIX + (k if k.startswith("text_model.") else "text_model." + k): v for k, v in state.items()}


def clip_g_to_sgm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIPTextModelWithProjection (text_encoder_2) -> OpenCLIP keys under ``conditioner.embedders.1.model.``
    (fused ``in_proj`` q/k/v, transposed ``text_projection``)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    simple = {
        "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
        "text_model.embeddings.position_embedding.weight": "positional_embedding",
        "text_model.final_layer_norm.weight": "ln_final.weight",
        "text_model.final_layer_norm.bias": "ln_final.bias",
    }
    for k, v in state.items():
        if k in simple:
            out[simple[k]] = v
        elif k == "text_projection.weight":
            out["text_projection"] = v.T.contiguous()
        elif m := re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", k):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = v
        elif m := re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.(.+)", k):
            rest = (
                m[2]
                .replace("self_attn.out_proj", "attn.out_proj")
                .replace("layer_norm1", "ln_1")
                .replace("layer_norm2", "ln_2")
                .replace("mlp.fc1", "mlp.c_fc")
                .replace("mlp.fc2", "mlp.c_proj")
            )
            out[f"transformer.resblocks.{m[1]}.{rest}"] = v
        elif k.endswith("position_ids"):
            continue
        else:
            raise ValueError(f"no OpenCLIP name for text_encoder_2 tensor {k!r}")
    for (layer, kind), parts in qkv.items():
        out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return {CLIP_G_PREFIX + k: v for k, v in out.items()}
