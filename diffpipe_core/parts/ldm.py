"""Key tables of the components Stability's original (LDM/SGM) single files hold beside the diffusion model: the LDM
VAE (SD 1.x/2.x, SDXL; Flux's and SD3's ``ae.safetensors`` name it alike), CLIP-L in transformers' names, and
OpenCLIP's text transformer (SD 2.x's, SDXL's ``text_encoder_2``). Each is sized from the component's diffusers
config and placed under the prefix the file keeps it under (SDXL: ``first_stage_model.``,
``conditioner.embedders.0.transformer.``, ``conditioner.embedders.1.model.``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module


def under(original: str, model: str, names: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """``names`` (``(original, model)`` suffixes) as :class:`KeyTable` renames below two module prefixes."""
    return [(f"{original}.{a}", f"{model}.{b}") for a, b in names]


def vae_table(config: Mapping[str, Any], prefix: str, model: str = "VAE") -> KeyTable:
    """The LDM layout of an ``AutoencoderKL`` config: decoder blocks numbered the other way, ``nin_shortcut``, the mid
    attention's projections as 1x1 convolutions."""
    n, levels = config["layers_per_block"], len(config["block_out_channels"])
    short = (("nin_shortcut", "conv_shortcut"),)
    renames: list[tuple[str, str]] = [(k, k) for k in ("quant_conv", "post_quant_conv")]
    modules = []
    for side in ("encoder", "decoder"):
        attn = f"{side}.mid_block.attentions.0"
        renames += [(f"{side}.{c}", f"{side}.{c}") for c in ("conv_in", "conv_out")]
        renames += [(f"{side}.norm_out", f"{side}.conv_norm_out"), (f"{side}.mid.attn_1.norm", f"{attn}.group_norm")]
        renames += [(f"{side}.mid.block_{j + 1}", f"{side}.mid_block.resnets.{j}") for j in range(2)]
        for a, b in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0")):
            modules.append(Module(f"{side}.mid.attn_1.{a}", (f"{attn}.{b}",), form="conv1x1"))
    for i in range(levels):
        for side, count, block, lvl in (("encoder", n, "down", i), ("decoder", n + 1, "up", levels - 1 - i)):
            for j in range(count):
                a, b = f"{side}.{block}.{lvl}.block.{j}", f"{side}.{block}_blocks.{i}.resnets.{j}"
                renames += [*under(a, b, short), (a, b)]
        if i < levels - 1:
            renames.append((f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv"))
            renames.append((f"decoder.up.{levels - 1 - i}.upsample.conv", f"decoder.up_blocks.{i}.upsamplers.0.conv"))
    return KeyTable(tuple(modules), "LDM", model, (prefix,), prefix, tuple(renames))


def clip_table(prefix: str, model: str = "CLIP text encoder") -> KeyTable:
    """CLIP-L (``CLIPTextModel``): transformers' names under ``<prefix>text_model.``."""
    where = prefix + "text_model."
    return KeyTable((), "original", model, (where,), where, passthrough=True, skip=r"position_ids$")


def open_clip_table(config: Mapping[str, Any], prefix: str, model: str = "OpenCLIP text encoder") -> KeyTable:
    """OpenCLIP's text transformer of a ``CLIPTextModel[WithProjection]`` config: fused ``in_proj`` q/k/v, a transposed
    ``text_projection``."""
    modules = [Module("", ("text_projection",), params=(("text_projection", "weight"),), form="transposed")]
    renames = [
        ("positional_embedding", "text_model.embeddings.position_embedding.weight"),
        ("token_embedding", "text_model.embeddings.token_embedding"),
        ("ln_final", "text_model.final_layer_norm"),
    ]
    names = (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"))
    for i in range(config["num_hidden_layers"]):
        a, b = f"transformer.resblocks.{i}", f"text_model.encoder.layers.{i}"
        qkv = tuple(f"{b}.self_attn.{x}_proj" for x in "qkv")
        modules.append(Module(f"{a}.attn", qkv, params=(("in_proj_weight", "weight"), ("in_proj_bias", "bias"))))
        renames += under(a, b, (*names, ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")))
    skip = r"position_ids$|logit_scale$"
    return KeyTable(tuple(modules), "OpenCLIP", model, (prefix,), prefix, tuple(renames), skip=skip)
