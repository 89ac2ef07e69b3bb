"""The original SGM (Stability generative-models) layout of an SDXL single-file checkpoint, as key tables: the UNet
under ``model.diffusion_model.`` (its table is here), the VAE under ``first_stage_model.``, CLIP-L under
``conditioner.embedders.0.transformer.`` and OpenCLIP-G under ``conditioner.embedders.1.model.`` (the core's LDM
tables, :mod:`diffpipe_core.parts.ldm`): what ComfyUI, A1111 and kohya read and write. Each table is sized from its
component's diffusers config; loading, per-stage loading, the ``single_file`` export and the kohya LoRA names all
read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable
from diffpipe_core.parts.ldm import clip_table, open_clip_table, under, vae_table

UNET, VAE, CLIP_L, CLIP_G = (
    "model.diffusion_model.",
    "first_stage_model.",
    "conditioner.embedders.0.transformer.",
    "conditioner.embedders.1.model.",
)
#: every SDXL checkpoint (base, refiner, fine-tunes) has two layers per down block
SDXL_LAYERS_PER_BLOCK = 2
CROSS = "CrossAttn"
RESNET = (
    ("in_layers.0", "norm1"),
    ("in_layers.2", "conv1"),
    ("emb_layers.1", "time_emb_proj"),
    ("out_layers.0", "norm2"),
    ("out_layers.3", "conv2"),
    ("skip_connection", "conv_shortcut"),
)
UNET_TOP = (
    ("time_embed.0", "time_embedding.linear_1"),
    ("time_embed.2", "time_embedding.linear_2"),
    ("label_emb.0.0", "add_embedding.linear_1"),
    ("label_emb.0.2", "add_embedding.linear_2"),
    ("input_blocks.0.0", "conv_in"),
    ("out.0", "conv_norm_out"),
    ("out.2", "conv_out"),
)


def unet_table(config: Mapping[str, Any]) -> KeyTable:
    """The SGM UNet of a ``UNet2DConditionModel`` config: ``down_blocks.1.attentions.0`` is ``input_blocks.4.1``,
    a resnet's ``norm1`` its ``in_layers.0``, ... (Segmind Vega's and SSD-1B's mid blocks included)."""
    n = config["layers_per_block"]
    if not isinstance(n, int):
        raise ValueError(f"UNet config layers_per_block={n!r}: only one value for every block is supported")
    down, up = config["down_block_types"], config["up_block_types"]
    renames = list(UNET_TOP)
    for i, kind in enumerate(down):
        for j in range(n):
            renames += under(f"input_blocks.{1 + i * (n + 1) + j}.0", f"down_blocks.{i}.resnets.{j}", RESNET)
            if CROSS in kind:
                renames.append((f"input_blocks.{1 + i * (n + 1) + j}.1", f"down_blocks.{i}.attentions.{j}"))
        if i < len(down) - 1:
            renames.append((f"input_blocks.{(i + 1) * (n + 1)}.0.op", f"down_blocks.{i}.downsamplers.0.conv"))
    mid = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid is not None:
        for j in range(2 if CROSS in mid else 1):
            renames += under(f"middle_block.{2 * j}", f"mid_block.resnets.{j}", RESNET)
        if CROSS in mid:
            renames.append(("middle_block.1", "mid_block.attentions.0"))
    for i, kind in enumerate(up):
        for j in range(n + 1):
            renames += under(f"output_blocks.{i * (n + 1) + j}.0", f"up_blocks.{i}.resnets.{j}", RESNET)
            if CROSS in kind:
                renames.append((f"output_blocks.{i * (n + 1) + j}.1", f"up_blocks.{i}.attentions.{j}"))
        if i < len(up) - 1:  # the upsampler follows the block's last resnet, or its attention
            where = f"output_blocks.{i * (n + 1) + n}.{2 if CROSS in kind else 1}.conv"
            renames.append((where, f"up_blocks.{i}.upsamplers.0.conv"))
    return KeyTable((), "SGM", "SDXL UNet", (UNET,), UNET, tuple(renames))


layout_for_config = unet_table  # the plugin's original layout (DiffusersModel.key_tables)


def lora_unet_table(modules: list[str]) -> KeyTable:
    """The UNet table for a LoRA's module names (no config at hand): as many blocks as the names reach, attention
    wherever one is adapted, SDXL's two layers per block."""

    def count(kind: str) -> int:
        return 1 + max((int(m.split(".")[1]) for m in modules if m.startswith(kind)), default=0)

    def types(kind: str) -> list[str]:
        adapted = {m.split(".")[1] for m in modules if m.startswith(kind) and ".attentions." in m}
        return [CROSS if str(i) in adapted else "" for i in range(count(kind))]

    config = {"layers_per_block": SDXL_LAYERS_PER_BLOCK, "down_block_types": types("down_blocks")}
    return unet_table({**config, "up_block_types": types("up_blocks")})


def component_tables(configs: Callable[[str], Mapping[str, Any]]) -> dict[str, KeyTable]:
    """The tables of the VAE and both text encoders, sized from ``configs(component)`` (their diffusers configs)."""
    return {
        "vae": vae_table(configs("vae"), VAE, "SDXL VAE"),
        "text_encoder": clip_table(CLIP_L, "SDXL text_encoder"),
        "text_encoder_2": open_clip_table(configs("text_encoder_2"), CLIP_G, "SDXL text_encoder_2"),
    }
