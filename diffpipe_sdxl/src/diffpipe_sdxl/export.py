"""Exports: LoRA in diffusers and kohya formats, full fine-tunes as a diffusers UNet folder or an
original-layout single-file checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from diffpipe_core.adapters import diffusers_format, kohya_format
from diffpipe_sdxl.config import SDXLConfig
from diffpipe_sdxl.sgm_layout import (
    CLIP_G_PREFIX,
    CLIP_L_PREFIX,
    VAE_PREFIX,
    UNetLayout,
    clip_g_to_sgm,
    clip_l_to_sgm,
    unet_name_to_sgm,
    unet_to_sgm,
    vae_to_ldm,
)

MODEL_FORMATS = ("diffusers", "single_file")


def export_adapter(state: dict[str, torch.Tensor], alpha: float, format: str) -> dict[str, torch.Tensor] | None:
    """``diffusers``: ``unet.<peft key>`` (``unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A
    .weight``), without ``.alpha`` tensors: diffusers' SDXL loader rejects keys without "lora" in them, reads alpha
    from the file's ``lora_adapter_metadata``, and ComfyUI does not load PEFT-format SDXL LoRAs anyway.
    ``kohya``: ``lora_unet_<SGM module>.lora_down/lora_up.weight`` plus ``.alpha``, e.g.
    ``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight`` (ComfyUI, A1111, diffusers).
    Other formats: None."""
    if format == "diffusers":
        return diffusers_format(state, "unet")
    if format == "kohya":
        # The SGM module names depend only on layers_per_block, which is 2 in every SDXL UNet.
        return kohya_format(state, alpha, prefix="lora_unet", rename=lambda module: unet_name_to_sgm(module))
    return None


def adapter_key_names(modules: list[str], format: str) -> dict[str, str] | None:
    """Key stems of a LoKr/LoHa: ``kohya`` names each module as :func:`export_adapter`'s kohya LoRA does
    (``lora_unet_<SGM module>``); other formats: None."""
    if format != "kohya":
        return None
    return {m: f"lora_unet_{unet_name_to_sgm(m).replace('.', '_')}" for m in modules}


def export_model(model: nn.Module, cfg: SDXLConfig, out_dir: Path, format: str) -> bool | None:
    """``diffusers``: ``out_dir/unet`` (``save_pretrained``). ``single_file``: ``out_dir/sdxl.safetensors`` in the
    original layout, the trained UNet plus the VAE and text encoders of the base checkpoint."""
    out_dir = Path(out_dir)
    if format == "diffusers":
        model.save_pretrained(out_dir / "unet", safe_serialization=True)  # type: ignore[operator]
        return True
    if format == "single_file":
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        tensors = unet_to_sgm(state, UNetLayout.from_config(model.config))  # type: ignore[attr-defined]
        tensors.update(base_components(cfg))
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out_dir / "sdxl.safetensors"), metadata={"format": "pt"})
        return True
    return None


def base_components(cfg: SDXLConfig) -> dict[str, torch.Tensor]:
    """The base model's VAE and text encoders in original-layout keys."""
    if cfg.path.is_file():
        with safe_open(str(cfg.path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith((VAE_PREFIX, CLIP_L_PREFIX, CLIP_G_PREFIX))}
    return folder_components(cfg.path)


def folder_components(folder: Path) -> dict[str, torch.Tensor]:
    """The VAE and text encoders of a diffusers SDXL folder in original-layout keys."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", local_files_only=True)
    te1 = CLIPTextModel.from_pretrained(folder / "text_encoder", local_files_only=True)
    te2 = CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder_2", local_files_only=True)
    out = vae_to_ldm(vae.state_dict(), len(vae.config.up_block_types))
    out.update(clip_l_to_sgm(te1.state_dict()))
    out.update(clip_g_to_sgm(te2.state_dict()))
    return {k: v.contiguous() for k, v in out.items()}


def export_saved_model(saved: Path, cfg: SDXLConfig, out_dir: Path, format: str) -> Path:
    """Turn a full fine-tune that diffpipe saved (``saved/<name>/model-*.safetensors``, keyed by UNet parameter
    names) into ``format`` (``diffusers`` or ``single_file``) under ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import load_file

    from diffpipe_sdxl.loading import build_unet

    if format not in MODEL_FORMATS:
        raise ValueError(f"unknown model export format {format!r}; valid: {', '.join(MODEL_FORMATS)}")
    shards = sorted(Path(saved).glob("model-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{saved}: no model-*.safetensors shards (is it a full fine-tune's saved folder?)")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    unet = build_unet(cfg, torch.device("meta"), torch.float32)
    names = unet.state_dict().keys()
    missing, unexpected = sorted(names - state.keys()), sorted(state.keys() - names)
    if missing or unexpected:
        raise ValueError(f"{saved}: does not match the UNet config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    unet.load_state_dict(state, assign=True)
    export_model(unet, cfg, out_dir, format)
    return Path(out_dir)
