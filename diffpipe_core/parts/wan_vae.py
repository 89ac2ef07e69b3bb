"""The original layout of the Wan VAE (the Wan repositories' ``WanVAE``, as ComfyUI and Wan's releases ship it:
``wan_2.1_vae.safetensors``, ``wan2.2_vae.safetensors``, ``Wan2.1_VAE.pth``), as a key table for diffusers'
``AutoencoderKLWan``, and for ``AutoencoderKLQwenImage``, which names its modules as the Wan 2.1 VAE does (ComfyUI's
``qwen_image_vae.safetensors``). Several model families share this VAE (Wan, Qwen-Image, Cosmos-Predict2/2.5), so the
table lives in the core; a plugin declares it in ``DiffusersFolder(file_layouts={"vae": wan_vae_table})``.

The two layouts differ by renames only (no fused tensors):

- a residual block's ``residual.0`` / ``.2`` / ``.3`` / ``.6`` / ``shortcut`` = ``norm1`` / ``conv1`` / ``norm2`` /
  ``conv2`` / ``conv_shortcut``; ``conv1`` / ``head.0`` / ``head.2`` of each side = ``conv_in`` / ``norm_out`` /
  ``conv_out``; ``middle.0/1/2`` = ``mid_block.resnets.0`` / ``attentions.0`` / ``resnets.1``; the top ``conv1`` /
  ``conv2`` = ``quant_conv`` / ``post_quant_conv``;
- Wan 2.1 (``is_residual`` false): the encoder's flat ``downsamples.K`` keep their numbers as ``down_blocks.K``; the
  decoder's flat ``upsamples.K`` are ``up_blocks.I.resnets.J`` and ``up_blocks.I.upsamplers.0``, counted in order;
- Wan 2.2 (``is_residual``): ``downsamples.I.downsamples.J`` = ``down_blocks.I.resnets.J`` (the last J: its
  ``downsampler``), ``upsamples.I.upsamples.J`` = ``up_blocks.I.resnets.J`` (the last J: its ``upsampler``).

Sizes (levels, blocks per level, attention scales) come from the component's diffusers config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable
from diffpipe_core.parts.ldm import under

#: a residual block's modules: (original, diffusers)
RESIDUAL = (("residual.0", "norm1"), ("residual.2", "conv1"), ("residual.3", "norm2"), ("residual.6", "conv2"),
            ("shortcut", "conv_shortcut"))  # fmt: skip


def wan_vae_table(config: Mapping[str, Any]) -> KeyTable:
    """The original Wan VAE layout of an ``AutoencoderKLWan`` (2.1 or 2.2) or ``AutoencoderKLQwenImage`` config."""
    levels = len(config.get("dim_mult", (1, 2, 4, 4)))
    blocks = int(config.get("num_res_blocks", 2))
    attention = list(config.get("attn_scales", ()))
    renames: list[tuple[str, str]] = [("conv1", "quant_conv"), ("conv2", "post_quant_conv")]
    for side in ("encoder", "decoder"):
        renames += [(f"{side}.conv1", f"{side}.conv_in"), (f"{side}.head.0", f"{side}.norm_out")]
        renames += [(f"{side}.head.2", f"{side}.conv_out"), (f"{side}.middle.1", f"{side}.mid_block.attentions.0")]
        for original, model in ((f"{side}.middle.0", "resnets.0"), (f"{side}.middle.2", "resnets.1")):
            renames += under(original, f"{side}.mid_block.{model}", RESIDUAL)
    if config.get("is_residual"):
        for i in range(levels):
            down, up = f"encoder.downsamples.{i}.downsamples", f"decoder.upsamples.{i}.upsamples"
            for j in range(blocks):
                renames += under(f"{down}.{j}", f"encoder.down_blocks.{i}.resnets.{j}", RESIDUAL)
            for j in range(blocks + 1):
                renames += under(f"{up}.{j}", f"decoder.up_blocks.{i}.resnets.{j}", RESIDUAL)
            if i < levels - 1:
                renames += [(f"{down}.{blocks}", f"encoder.down_blocks.{i}.downsampler")]
                renames += [(f"{up}.{blocks + 1}", f"decoder.up_blocks.{i}.upsampler")]
    else:
        k, scale = 0, 1.0
        for i in range(levels):
            for _ in range(blocks):
                renames += under(f"encoder.downsamples.{k}", f"encoder.down_blocks.{k}", RESIDUAL)
                k += 1
                if scale in attention:  # an attention block keeps its inner names
                    renames.append((f"encoder.downsamples.{k}", f"encoder.down_blocks.{k}"))
                    k += 1
            if i < levels - 1:
                renames.append((f"encoder.downsamples.{k}", f"encoder.down_blocks.{k}"))  # the resample
                k += 1
                scale /= 2
        k = 0
        for i in range(levels):
            for j in range(blocks + 1):
                renames += under(f"decoder.upsamples.{k}", f"decoder.up_blocks.{i}.resnets.{j}", RESIDUAL)
                k += 1
            if i < levels - 1:
                renames.append((f"decoder.upsamples.{k}", f"decoder.up_blocks.{i}.upsamplers.0"))
                k += 1
    return KeyTable((), "original Wan VAE", "Wan VAE", ("first_stage_model.", ""), "", tuple(renames))
