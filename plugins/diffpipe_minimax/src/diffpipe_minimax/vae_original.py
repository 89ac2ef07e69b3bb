"""The original layout of MiniMax H3's video VAE (the reference implementation's, as ComfyUI's
``comfy/ldm/minimax/vae.py`` holds it and Comfy-Org's ``minimax_h3_video_vae_*.safetensors`` stores it), as a key table
for diffusers' ``AutoencoderKLMiniMaxH3``: the inverse of ``convert_video_vae_key`` in diffusers'
``scripts/convert_minimax_h3_to_diffusers.py``.

What differs from diffusers' names:

- the encoder's levels ``encoder.down.I.block.J`` (``nin_shortcut``) and ``encoder.down.I.downsample`` are
  ``encoder.down_blocks.I.resnets.J`` (``conv_shortcut``) and ``encoder.down_blocks.I.downsamplers.0``;
- the ViT decoder's ``x_embedder`` is ``proj_in``; each block's fused ``attn.to_qkv`` holds q, k and v interleaved per
  head (``[head 0: q k v; head 1: q k v; ...]``), weight and bias; ``attn.to_out`` is ``attn.to_out.0``; the gated
  MLP's ``ff.w1`` holds ``[gate; up]`` where diffusers' SwiGLU ``ff.net.0.proj`` holds ``[up; gate]`` (the halves
  swapped), ``ff.w2`` is ``ff.net.2``;
- ``decoder.mask_token`` (unused at inference) and ComfyUI's ``latents_mean`` / ``latents_std`` buffers (diffusers keeps
  them in the config) are not the model's; everything else keeps its name.

Sizes (levels, blocks per level, decoder blocks and heads) come from the component's diffusers config.

The audio VAE (``AutoencoderKLMiniMaxH3Audio``, ComfyUI's ``comfy/ldm/minimax/audio_vae.py`` and Comfy-Org's
``minimax_h3_audio_vae_*.safetensors``) names every module as diffusers does, but ComfyUI's file holds each
weight-normed convolution's ``weight_g`` / ``weight_v`` folded into one ``weight``: :func:`audio_vae_table` reads it as
``weight_v`` = the weight and ``weight_g`` = its norm (the same convolution), and leaves out ComfyUI's
``latents_mean`` / ``latents_std`` buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import WEIGHT_NORM, KeyTable, Module


def _decoder_block(i: int, heads: int) -> tuple[Module, ...]:
    block = f"decoder.transformer_blocks.{i}"
    return (
        Module(f"{block}.attn.to_qkv", tuple(f"{block}.attn.to_{p}" for p in "qkv"), groups=heads, comfy=None),
        Module(f"{block}.attn.to_out", (f"{block}.attn.to_out.0",), comfy=None),
        Module(f"{block}.ff.w1", (f"{block}.ff.net.0.proj",), swap=True, comfy=None),
        Module(f"{block}.ff.w2", (f"{block}.ff.net.2",), comfy=None),
    )


def video_vae_table(config: Mapping[str, Any]) -> KeyTable:
    """The original layout of an ``AutoencoderKLMiniMaxH3`` of this config."""
    levels = len(config.get("block_out_channels", (128, 256, 256, 512, 512, 1024)))
    blocks = int(config.get("layers_per_block", 2))
    renames: list[tuple[str, str]] = [("decoder.x_embedder", "decoder.proj_in")]
    for i in range(levels):
        original, ours = f"encoder.down.{i}", f"encoder.down_blocks.{i}"
        renames += [(f"{original}.block.{j}.nin_shortcut", f"{ours}.resnets.{j}.conv_shortcut") for j in range(blocks)]
        renames += [(f"{original}.block", f"{ours}.resnets"), (f"{original}.downsample", f"{ours}.downsamplers.0")]
    heads = int(config.get("decoder_num_attention_heads", 32))
    modules = tuple(m for i in range(int(config.get("decoder_num_layers", 36))) for m in _decoder_block(i, heads))
    return KeyTable(modules, "original MiniMax H3 video VAE", "MiniMax H3 video VAE",
                    ("first_stage_model.", "vae.", ""), renames=tuple(renames), passthrough=True,
                    skip=r"^(decoder\.mask_token|latents_mean|latents_std)$")


def audio_vae_table(config: Mapping[str, Any]) -> KeyTable:
    """ComfyUI's layout of an ``AutoencoderKLMiniMaxH3Audio`` of this config (its weight-normed convolutions, found
    in the model built on the meta device, folded)."""
    import torch
    from diffusers import AutoencoderKLMiniMaxH3Audio

    with torch.device("meta"):
        model = AutoencoderKLMiniMaxH3Audio.from_config(dict(config))
    normed = [name for name, module in model.named_modules() if hasattr(module, "weight_g")]
    params = (("weight", "weight_v"), ("bias", "bias"))
    modules = tuple(Module(name, (name,), params=params, form=WEIGHT_NORM, comfy=None) for name in normed)
    return KeyTable(modules, "ComfyUI MiniMax H3 audio VAE", "MiniMax H3 audio VAE",
                    ("first_stage_model.", "audio_vae.", ""), passthrough=True, skip=r"^(latents_mean|latents_std)$")
