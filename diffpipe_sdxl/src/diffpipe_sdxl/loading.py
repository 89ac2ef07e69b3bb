"""Loading SDXL from local files: a diffusers folder, or a single-file original-layout checkpoint plus a
diffusers folder for configs and tokenizers. Nothing is fetched from the hub (``local_files_only``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from diffpipe_core.engine.model_loading import cast_skeleton
from diffpipe_sdxl.config import SDXLConfig
from diffpipe_sdxl.sgm_layout import (
    CLIP_G_PREFIX,
    CLIP_L_PREFIX,
    UNET_PREFIX,
    VAE_PREFIX,
    UNetLayout,
    sgm_to_unet_names,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_folder(cfg: SDXLConfig) -> Path:
    """The diffusers folder that supplies configs and tokenizers."""
    folder = cfg.config_path if cfg.path.is_file() else cfg.path
    assert folder is not None  # SDXLConfig requires config_path for a single file
    if not (folder / "unet" / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder}: not a diffusers SDXL folder (unet/config.json missing); expected model_index.json, unet/, "
            "vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/"
        )
    return folder


def unet_config(cfg: SDXLConfig) -> dict[str, Any]:
    return json.loads((config_folder(cfg) / "unet" / "config.json").read_text())


def _check_single_file_unet(file: Path, names: list[str], layout: UNetLayout, folder: Path) -> dict[str, str]:
    """``{file key: UNet name}``; raises ValueError naming the file and keys when the UNet tensors in the file do
    not match the configured UNet."""
    expected = sgm_to_unet_names(names, layout)
    with safe_open(str(file), framework="pt") as f:
        present = {k for k in f.keys() if k.startswith(UNET_PREFIX)}
    if not present:
        raise ValueError(f"{file}: no UNet tensors (keys starting with {UNET_PREFIX!r}); not an SDXL checkpoint")
    unexpected, missing = sorted(present - expected.keys()), sorted(expected.keys() - present)
    if unexpected or missing:
        raise ValueError(
            f"{file}: the UNet tensors do not match the UNet config in {folder / 'unet' / 'config.json'}: "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:3]}), {len(missing)} missing (e.g. {missing[:3]})"
        )
    return expected


def build_unet(cfg: SDXLConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The UNet: on ``meta`` a skeleton from its config, otherwise loaded with its weights."""
    from diffusers import UNet2DConditionModel

    folder = config_folder(cfg)
    if device.type == "meta":
        with torch.device("meta"):
            unet = UNet2DConditionModel.from_config(unet_config(cfg))
        return cast_skeleton(unet, dtype)
    if cfg.path.is_file():
        names = list(build_unet(cfg, torch.device("meta"), dtype).state_dict())
        _check_single_file_unet(cfg.path, names, UNetLayout.from_config(unet_config(cfg)), config_folder(cfg))
        unet = UNet2DConditionModel.from_single_file(
            str(cfg.path), config=str(folder), subfolder="unet", torch_dtype=dtype, local_files_only=True
        )
    else:
        unet = UNet2DConditionModel.from_pretrained(
            folder, subfolder="unet", torch_dtype=dtype, variant=unet_variant(folder), local_files_only=True
        )
    return unet.to(device)


def unet_weight_files(cfg: SDXLConfig) -> list[tuple[Path, Callable[[str], str | None]]]:
    """Where the UNet's tensors live, for per-stage loading: ``(file, key -> UNet name)`` pairs."""
    if cfg.path.is_file():
        names = list(build_unet(cfg, torch.device("meta"), torch.float32).state_dict())
        mapping = _check_single_file_unet(cfg.path, names, UNetLayout.from_config(unet_config(cfg)), config_folder(cfg))
        return [(cfg.path, mapping.get)]
    unet_dir = cfg.path / "unet"
    stem = "diffusion_pytorch_model" + (f".{v}" if (v := unet_variant(cfg.path)) else "")
    index = unet_dir / f"{stem}.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [(unet_dir / f, lambda k: k) for f in files]
    return [(unet_dir / f"{stem}.safetensors", lambda k: k)]


def unet_variant(folder: Path) -> str | None:
    """None for ``unet/diffusion_pytorch_model.safetensors`` (or its sharded index), ``"fp16"`` when only the
    fp16 variant is there (as in some hub downloads)."""
    unet_dir = folder / "unet"
    for variant in (None, "fp16"):
        stem = "diffusion_pytorch_model" + (f".{variant}" if variant else "")
        if (unet_dir / f"{stem}.safetensors").is_file() or (unet_dir / f"{stem}.safetensors.index.json").is_file():
            return variant
    raise FileNotFoundError(
        f"{unet_dir}: no UNet weights (diffusion_pytorch_model[.fp16].safetensors or its .index.json); "
        "only safetensors are read"
    )


def _single_file_parts(file: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefixes)}


@dataclass
class Encoders:
    """Everything ``encode_batch`` needs; dropped by the core before training."""

    vae: Any
    tokenizers: tuple[Any, Any]
    text_encoders: tuple[Any, Any]
    max_prompt_chunks: int


def load_encoders(cfg: SDXLConfig, device: torch.device) -> Encoders:
    """VAE, both CLIP text encoders and their tokenizers."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    folder = config_folder(cfg)
    vae_dtype, te_dtype = DTYPES[cfg.vae_dtype], DTYPES[cfg.text_encoder_dtype]
    tokenizers = (
        CLIPTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True),
        CLIPTokenizer.from_pretrained(folder / "tokenizer_2", local_files_only=True),
    )
    if cfg.path.is_file():
        parts = _single_file_parts(cfg.path, (CLIP_L_PREFIX, CLIP_G_PREFIX, VAE_PREFIX))
        te1 = create_diffusers_clip_model_from_ldm(
            CLIPTextModel,
            parts,
            subfolder="text_encoder",
            config=str(folder),
            torch_dtype=te_dtype,
            local_files_only=True,
        )
        te2 = create_diffusers_clip_model_from_ldm(
            CLIPTextModelWithProjection,
            parts,
            subfolder="text_encoder_2",
            config=str(folder),
            torch_dtype=te_dtype,
            local_files_only=True,
        )
        vae = None
        if cfg.vae_path is None:
            vae_parts = {k: v for k, v in parts.items() if k.startswith(VAE_PREFIX)}
            if not vae_parts:
                raise ValueError(f"{cfg.path}: no VAE tensors (keys starting with {VAE_PREFIX!r}); set vae_path")
            vae = AutoencoderKL.from_single_file(
                vae_parts, config=str(folder), subfolder="vae", torch_dtype=vae_dtype, local_files_only=True
            )
    else:
        te1 = CLIPTextModel.from_pretrained(folder / "text_encoder", torch_dtype=te_dtype, local_files_only=True)
        te2 = CLIPTextModelWithProjection.from_pretrained(
            folder / "text_encoder_2", torch_dtype=te_dtype, local_files_only=True
        )
        vae = (
            None
            if cfg.vae_path is not None
            else AutoencoderKL.from_pretrained(folder, subfolder="vae", torch_dtype=vae_dtype, local_files_only=True)
        )
    if cfg.vae_path is not None:
        vae = AutoencoderKL.from_pretrained(cfg.vae_path, torch_dtype=vae_dtype, local_files_only=True)
    return Encoders(
        vae=vae.to(device).eval(),
        tokenizers=tokenizers,
        text_encoders=(te1.to(device).eval(), te2.to(device).eval()),
        max_prompt_chunks=cfg.max_prompt_chunks,
    )
