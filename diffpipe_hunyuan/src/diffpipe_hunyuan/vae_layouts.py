"""The VAE files of HunyuanVideo and HunyuanVideo-1.5 in the layouts ComfyUI reads, as key tables of the diffusers
VAEs (``[model] vae``; one table per layout, both directions).

- HunyuanVideo (``hunyuan_video_vae_bf16.safetensors``): Tencent's file names its tensors as diffusers'
  ``AutoencoderKLHunyuanVideo`` does (read without a table); ComfyUI holds the VAE as its LDM ``AutoencoderKL`` with
  3-D convolutions (``encoder.down.0.block.0.conv1.conv.weight``, ``decoder.up.3.upsample.conv.conv.weight``, the mid
  attention's ``q``/``k``/``v``/``proj_out`` as 1x1x1 convolutions): :func:`ldm_vae_table`, the core's LDM table with
  those convolutions.
- HunyuanVideo-1.5 (``hunyuanvideo15_vae_fp16.safetensors``): Tencent's layout, which ComfyUI's
  ``comfy/ldm/hunyuan_video/vae_refiner.py`` holds as is (``encoder.down.0.block.0.norm1.gamma``,
  ``encoder.mid.attn_1.q.weight``, ``decoder.up.0.upsample.conv.conv.weight``, the decoder's levels in diffusers'
  order): :func:`vae15_table`, the mapping of diffusers' ``convert_hunyuan_video_15_vae_checkpoint_to_diffusers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from diffpipe_core.parts.layout import KeyTable
from diffpipe_core.parts.ldm import under, vae_table

SHORTCUT = (("nin_shortcut", "conv_shortcut"),)


def ldm_vae_table(config: Mapping[str, Any]) -> KeyTable:
    """ComfyUI's LDM layout of an ``AutoencoderKLHunyuanVideo`` config (the mid attention's linears as 1x1x1
    convolutions)."""
    table = vae_table(config, "", "HunyuanVideo VAE")
    modules = tuple(replace(m, form="conv1x1x1") for m in table.modules)
    return replace(table, modules=modules, name="ComfyUI LDM (3-D)")


def vae15_table(config: Mapping[str, Any]) -> KeyTable:
    """Tencent's (and ComfyUI's) layout of an ``AutoencoderKLHunyuanVideo15`` config."""
    n, levels = int(config["layers_per_block"]), len(config["block_out_channels"])
    renames: list[tuple[str, str]] = []
    for side, level, resnets, sampler, blocks, samplers in (
        ("encoder", "down", n, "downsample", "down_blocks", "downsamplers"),
        ("decoder", "up", n + 1, "upsample", "up_blocks", "upsamplers"),
    ):
        for i in range(levels):
            for j in range(resnets):
                a, b = f"{side}.{level}.{i}.block.{j}", f"{side}.{blocks}.{i}.resnets.{j}"
                renames += [*under(a, b, SHORTCUT), (a, b)]
            renames.append((f"{side}.{level}.{i}.{sampler}", f"{side}.{blocks}.{i}.{samplers}.0"))
        renames += [(f"{side}.mid.block_{j + 1}", f"{side}.mid_block.resnets.{j}") for j in range(2)]
        attention = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "proj_out"), ("norm", "norm"))
        renames += under(f"{side}.mid.attn_1", f"{side}.mid_block.attentions.0", attention)
        renames += [(f"{side}.{c}", f"{side}.{c}") for c in ("conv_in", "norm_out", "conv_out")]
    return KeyTable((), "original Tencent", "HunyuanVideo-1.5 VAE", ("",), "", tuple(renames))


def vae21_table(config: Mapping[str, Any]) -> KeyTable:
    """Tencent's (and ComfyUI's) layout of an ``AutoencoderKLHunyuanImage`` config (``hunyuan_image_2.1_vae_fp16``):
    ``encoder.down.i.block.j`` / ``.downsample`` are diffusers' flat ``encoder.down_blocks.k`` (the decoder's
    ``up.i.block.j`` / ``.upsample`` likewise ``up_blocks.k``), the mid block's ``block_1`` / ``attn_1`` (``q``, ``k``,
    ``v``, ``proj_out``) its ``resnets`` / ``attentions.0`` (``to_q``, ..., ``proj``); the mapping of diffusers'
    ``convert_hunyuan_image_vae_checkpoint_to_diffusers``."""
    import math

    n, levels = int(config["layers_per_block"]), len(config["block_out_channels"])
    samplers = int(math.log2(int(config["spatial_compression_ratio"])))
    renames: list[tuple[str, str]] = []
    for side, level, resnets, sampler, blocks in (
        ("encoder", "down", n, "downsample", "down_blocks"),
        ("decoder", "up", n + 1, "upsample", "up_blocks"),
    ):
        k = 0
        for i in range(levels):
            for j in range(resnets):
                a, b = f"{side}.{level}.{i}.block.{j}", f"{side}.{blocks}.{k}"
                renames += [*under(a, b, SHORTCUT), (a, b)]
                k += 1
            if i < samplers and i != levels - 1:
                renames.append((f"{side}.{level}.{i}.{sampler}", f"{side}.{blocks}.{k}"))
                k += 1
        renames += [(f"{side}.mid.block_{j + 1}", f"{side}.mid_block.resnets.{j}") for j in range(2)]
        attention = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "proj"), ("norm", "norm"))
        renames += under(f"{side}.mid.attn_1", f"{side}.mid_block.attentions.0", attention)
        renames += [(f"{side}.{c}", f"{side}.{c}") for c in ("conv_in", "norm_out", "conv_out")]
    return KeyTable((), "original Tencent", "HunyuanImage-2.1 VAE", ("",), "", tuple(renames))
