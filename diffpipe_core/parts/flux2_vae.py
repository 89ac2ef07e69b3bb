"""FLUX.2's VAE (``AutoencoderKLFlux2``), which FLUX.2 and Ideogram 4 share: its file layout (``flux2-vae.safetensors``,
BFL's ``ae.safetensors``) as a key table, and the latent batch norm's statistics (``vae.bn``) the pipelines normalise
the 2x2-patchified latents with. Each pipeline patchifies in its own channel order (FLUX.2: ``4c + 2dy + dx``;
Ideogram 4: ``(2dy + dx) * C + c``), and its statistics follow that order, so the patchify stays with the plugin."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diffpipe_core.parts.layout import KeyTable

if TYPE_CHECKING:
    import torch


def vae_layout(config: Mapping[str, Any]) -> KeyTable:
    """FLUX.2's VAE file: the LDM layout of its config, with the quantization convolutions inside the encoder and
    decoder (``encoder.quant_conv``, ``decoder.post_quant_conv``) and the latent batch norm's statistics
    (``bn.running_mean`` / ``running_var``) under the model's own names."""
    from diffpipe_core.parts.ldm import vae_table

    ldm = vae_table(config, "")
    own = (("encoder.quant_conv", "quant_conv"), ("decoder.post_quant_conv", "post_quant_conv"), ("bn", "bn"))
    return replace(ldm, name="BFL", model="FLUX.2 VAE", renames=own + ldm.renames)


def bn_stats(vae: Any, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-patch-channel mean and std, float32 on the CPU: ``bn.running_mean``, ``sqrt(bn.running_var +
    eps)``; ``eps`` defaults to the config's ``batch_norm_eps`` (ERNIE-Image's pipeline uses 1e-5, the trained value,
    whatever the config says)."""
    import torch

    mean = vae.bn.running_mean.float().cpu()
    eps = vae.config.batch_norm_eps if eps is None else eps
    return mean, torch.sqrt(vae.bn.running_var.float().cpu() + eps)
