"""The original Lightricks (LTX-Video repository, ComfyUI) key layout of the LTX-Video VAE, as a key table: the inverse
of diffusers' ``convert_ltx_vae_checkpoint_to_diffusers`` for every VAE version (0.9.0 to 0.9.7).

The original numbers the encoder's and decoder's parts in one flat list each. The encoder's ``down_blocks.N`` are, in
order, each diffusers down block's resnets (``res_blocks``), its downsampler and its channel-changing ``conv_out``
(those it has), then the mid block; the decoder's ``up_blocks.N`` are the mid block, then each up block's
channel-changing ``conv_in``, its upsampler and its resnets. Inside a resnet the original's ``conv_shortcut`` is a
plain convolution (diffusers' ``conv_shortcut.conv``) and ``norm3`` wraps its LayerNorm (``norm3.norm``); the
decoder's own timestep embedding is ``last_time_embedder`` / ``last_scale_shift_table``; the latent statistics are
``per_channel_statistics.mean-of-means`` / ``std-of-means`` (the file's ``channel`` and ``mean-of-stds`` are not the
model's). The single checkpoints (``ltx-video-2b-v0.9.5.safetensors``) hold the VAE under ``vae.``; a VAE file of its
own has no prefix. The table is built from the VAE's config, so tiny test VAEs and the released ones convert alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable

FILE_PREFIX = "vae."
TOP_RENAMES = {
    "latents_mean": "per_channel_statistics.mean-of-means",
    "latents_std": "per_channel_statistics.std-of-means",
    "decoder.time_embedder.": "decoder.last_time_embedder.",
    "decoder.scale_shift_table": "decoder.last_scale_shift_table",
}


def _flat_groups(keys: list[str], side: str) -> list[str]:
    """The diffusers module paths of ``side``'s original flat ``down_blocks`` / ``up_blocks`` list, in its order."""
    blocks = "down_blocks" if side == "encoder" else "up_blocks"
    count = len({k.split(".")[2] for k in keys if k.startswith(f"{side}.{blocks}.")})
    parts = ("resnets", "downsamplers.0", "conv_out") if side == "encoder" else ("conv_in", "upsamplers.0", "resnets")
    groups = [] if side == "encoder" else [f"{side}.mid_block"]
    for i in range(count):
        present = [f"{side}.{blocks}.{i}.{p}" for p in parts]
        groups += [g for g in present if any(k.startswith(g + ".") for k in keys)]
    return groups + ([f"{side}.mid_block"] if side == "encoder" else [])


def original_key(key: str, groups: Mapping[str, list[str]], ltxv_resnets: bool = True) -> str:
    """A diffusers VAE key -> its original Lightricks key (no file prefix). ``ltxv_resnets``: LTX-Video's resnets, whose
    shortcut convolution and third norm the original names differently (LTX-2's name them as diffusers does)."""
    for ours, theirs in TOP_RENAMES.items():
        if key == ours or (ours.endswith(".") and key.startswith(ours)):
            return theirs + key[len(ours) :]
    side = key.split(".")[0]
    blocks = "down_blocks" if side == "encoder" else "up_blocks"
    own = groups.get(side, [])
    for index, group in enumerate(own):
        if group.endswith((".resnets", ".mid_block")):  # the block's res group: all of it but its other parts
            block = group.removesuffix(".resnets")
            if not key.startswith(block + ".") or any(key.startswith(g + ".") for g in own if g != group):
                continue
            rest = re.sub(r"^resnets\.", "res_blocks.", key[len(block) + 1 :])
        elif key.startswith(group + "."):
            rest = key[len(group) + 1 :]
        else:
            continue
        if ltxv_resnets:
            rest = re.sub(r"(^|\.)norm3\.", r"\1norm3.norm.", rest.replace("conv_shortcut.conv.", "conv_shortcut."))
        return f"{side}.{blocks}.{index}.{rest}"
    return key


def vae_table(config: Mapping[str, Any]) -> KeyTable:
    """The original layout of an ``AutoencoderKLLTXVideo`` of ``config``: every tensor's original key, as renames."""
    return _video_vae_table("AutoencoderKLLTXVideo", config, "LTX-Video VAE", ltxv_resnets=True)


def ltx2_vae_table(config: Mapping[str, Any]) -> KeyTable:
    """The original layout of LTX-2's video VAE (``AutoencoderKLLTX2Video``; ``vae.*`` of the checkpoint
    ``ltx-2-19b-dev.safetensors``): the same flat block lists, resnets named as diffusers names them."""
    return _video_vae_table("AutoencoderKLLTX2Video", config, "LTX-2 video VAE", ltxv_resnets=False)


def ltx2_audio_vae_table(config: Mapping[str, Any]) -> KeyTable:
    """The original layout of LTX-2's audio VAE (``audio_vae.*`` of the checkpoint): diffusers' names but for the
    latent statistics."""
    return KeyTable(
        (),
        name="original Lightricks",
        model="LTX-2 audio VAE",
        read_prefixes=("audio_vae.",),
        write_prefix="audio_vae.",
        renames=tuple((v, k) for k, v in TOP_RENAMES.items() if k.startswith("latents_")),
        passthrough=True,
        skip=STATISTICS_SKIP,
    )


STATISTICS_SKIP = r"^per_channel_statistics\.(channel|mean-of-stds)$"


def _video_vae_table(class_name: str, config: Mapping[str, Any], model_name: str, ltxv_resnets: bool) -> KeyTable:
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = getattr(diffusers, class_name).from_config({k: v for k, v in config.items() if not k.startswith("_")})
    keys = list(model.state_dict())
    groups = {side: _flat_groups(keys, side) for side in ("encoder", "decoder")}
    return KeyTable(
        (),
        name="original Lightricks",
        model=model_name,
        read_prefixes=(FILE_PREFIX,),
        write_prefix=FILE_PREFIX,
        renames=tuple((original_key(k, groups, ltxv_resnets), k) for k in keys),
        skip=STATISTICS_SKIP,
    )
