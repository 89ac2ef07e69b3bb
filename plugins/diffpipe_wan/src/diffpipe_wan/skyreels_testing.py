"""Write a tiny random-weight SkyReels V2 to disk in its real layouts, for tests, the demo and the GPU-fit check.

:func:`write_tiny_skyreels` saves a complete diffusers folder of ``SkyReelsV2Pipeline`` (text-to-video),
``SkyReelsV2DiffusionForcingPipeline`` or ``SkyReelsV2ImageToVideoPipeline`` (with the CLIP vision encoder): the
tiny Wan's VAE, UMT5 and tokenizer (:mod:`diffpipe_wan.testing`), a ``SkyReelsV2Transformer3DModel`` and the released
folders' scheduler (``UniPCMultistepScheduler`` with flow sigmas, ``flow_shift`` 8 for text-to-video, 5 for
image-to-video). Beside the folder the transformer is written as one safetensors file in the original Wan key layout
(``<folder>.wan.safetensors``), as the SkyReels repositories and ComfyUI ship it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing import tiny
from diffpipe_wan import testing as wan_testing
from diffpipe_wan.skyreels_keys import layout_for_config

PIPELINES = {
    "t2v": "SkyReelsV2Pipeline",
    "df": "SkyReelsV2DiffusionForcingPipeline",
    "i2v": "SkyReelsV2ImageToVideoPipeline",
}


def tiny_transformer(cfg: wan_testing.TinyWanConfig, fps: bool = False):
    """The random-weight ``SkyReelsV2Transformer3DModel`` of the tiny Wan's sizes (``fps``: with the frame-rate
    embedding, ``inject_sample_info``)."""
    from diffusers import SkyReelsV2Transformer3DModel

    sizes = dict(wan_testing.tiny_transformer(cfg).config)  # the same sizes (I2V: channels, CLIP image embedder)
    torch.manual_seed(cfg.seed)
    return SkyReelsV2Transformer3DModel.from_config({**sizes, "inject_sample_info": fps})


def unipc(shift: float):
    """The released SkyReels V2 folders' scheduler."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)


def single_file_path(folder: Path) -> Path:
    """Where :func:`write_tiny_skyreels` puts the transformer's original-layout single file."""
    return wan_testing.single_file_path(folder)


def write_tiny_skyreels(folder: Path, variant: str = "t2v", fps: bool = False) -> Path:
    """Save a tiny SkyReels V2 folder of ``variant`` (``"t2v"``, ``"df"``, ``"i2v"``) at ``folder`` and its
    transformer in the original layout at :func:`single_file_path`."""
    if variant not in PIPELINES:
        raise ValueError(f"unknown SkyReels V2 variant {variant!r}; valid: {', '.join(PIPELINES)}")
    cfg = wan_testing.TinyWanConfig(i2v=variant == "i2v", clip=variant == "i2v")
    parts = wan_testing.parts(cfg)
    parts["transformer"] = tiny.Part(lambda: tiny_transformer(cfg, fps))
    parts["scheduler"] = tiny.Part(lambda: unipc(5.0 if variant == "i2v" else 8.0))
    folder = Path(folder)
    pipe = tiny.write_pipeline(PIPELINES[variant], parts, folder)
    original = layout_for_config(pipe.transformer.config).to_original(pipe.transformer.state_dict())
    tiny.save_single_file(original, single_file_path(folder))
    return folder


def write_tiny_skyreels_df(folder: Path) -> Path:
    """The tiny diffusion-forcing folder (``skyreels-v2`` with ``SkyReelsV2DiffusionForcingPipeline``)."""
    return write_tiny_skyreels(folder, "df")


def write_tiny_skyreels_i2v(folder: Path) -> Path:
    """The tiny image-to-video folder (``skyreels-v2-i2v``)."""
    return write_tiny_skyreels(folder, "i2v")
