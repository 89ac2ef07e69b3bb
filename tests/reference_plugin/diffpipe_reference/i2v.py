"""An image-to-video variant of the reference model (entry point ``reference-i2v``, registered by the tests).

A video model only in name: each frame goes through the tiny VAE, and the tiny DiT sees the latent frames side by
side along the width, after the clean latents of the clip's first frame (which the core decodes and hands to
``encode_batch`` as ``first_frames``). A stand-in "image encoder" (pooled first-frame pixels) is added to the text
embeddings, so both kinds of first-frame conditioning (image latents and image-encoder embeddings) are cached with
the clip and used. The model trains image-to-video only: an image in its dataset is an error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_reference.plugin import (  # noqa: F401  (hook implementations of this plugin too)
    ReferenceConfig,
    adapter_key_prefix,
    diffusion_model_weights,
    load_diffusion_model,
    load_encoders,
    lora_targets,
    split_into_layers,
    validate_model_files,
)

if TYPE_CHECKING:
    import torch

    from diffpipe_core import EncodeBatch, TrainingContext

I2V_SPEC = replace(
    TINY_VIDEO_SPEC,
    name="reference-i2v",
    config_schema=ReferenceConfig,
    encoder_settings=("path",),
    block_layers=("BlockLayer",),
    first_frame="required",
    description="The reference model trained image-to-video (tests)",
)


@hookimpl
def model_spec() -> ModelSpec:
    return I2V_SPEC


def image_embeds(first_frames: torch.Tensor, dim: int) -> torch.Tensor:
    """The stand-in image encoder: ``(B, 3, H, W)`` pixels average-pooled to ``(B, dim)``."""
    import torch.nn.functional as F

    return F.adaptive_avg_pool1d(first_frames.float().flatten(1)[:, None], dim)[:, 0]


@hookimpl
def encode_batch(encoders, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Videos: per-frame ``latents`` ``(B, C, F, h, w)``, and from ``batch.first_frames`` the
    ``first_frame_latents`` ``(B, C, h, w)`` and ``image_embeds`` ``(B, text_dim)``. Captions: ``text_embeds``."""
    import torch

    vae, text_encoder = encoders
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if batch.pixels is not None:
            pixels = batch.pixels.to(vae.proj.weight.device, torch.float32)
            if pixels.ndim != 5 or batch.first_frames is None:
                raise ValueError(f"reference-i2v encodes video clips with their first frame; got pixels of shape "
                                 f"{tuple(pixels.shape)} and first_frames {batch.first_frames is not None}")
            b, c, f, h, w = pixels.shape
            frames = vae.encode(pixels.transpose(1, 2).reshape(b * f, c, h, w))
            out["latents"] = frames.reshape(b, f, *frames.shape[1:]).transpose(1, 2).contiguous()
            first = batch.first_frames.to(pixels)
            out["first_frame_latents"] = vae.encode(first)
            out["image_embeds"] = image_embeds(first, text_encoder.proj.out_features)
        if batch.captions is not None:
            out["text_embeds"] = text_encoder(batch.captions)
    return out


def fold(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, F, h, w)`` -> ``(B, C, h, F * w)``: the frames side by side."""
    b, c, f, h, w = latents.shape
    return latents.permute(0, 1, 3, 2, 4).reshape(b, c, h, f * w)


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """``([first-frame latents | noisy frames], t, text + image embedding)`` and the folded velocity target."""
    import torch

    from diffpipe_core.parts.flow import flow_sample

    cfg: ReferenceConfig = context.model_config  # type: ignore[assignment]
    s = flow_sample(batch["latents"], cfg, context, generator, time_range=(0.0, 1.0))  # type: ignore[arg-type]
    x = torch.cat([batch["first_frame_latents"].float(), fold(s.x_t)], dim=-1)
    text = batch["text_embeds"].float() + batch["image_embeds"].float()[:, None]
    return (x, s.t, text), (fold(s.target),)


@hookimpl
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """MSE on the clip's frames (the columns after the first frame's)."""
    from diffpipe_core.diffusion import masked_mse

    target = targets[0]
    return masked_mse(outputs[0][..., -target.shape[-1] :], target)
