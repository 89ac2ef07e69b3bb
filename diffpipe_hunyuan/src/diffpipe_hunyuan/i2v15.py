"""HunyuanVideo-1.5 image-to-video (entry point ``hunyuan-video-1.5-i2v``), as ``HunyuanVideo15ImageToVideoPipeline``
runs it.

Each clip is cached with its first frame's conditioning (the core hands ``encode_batch`` the clips' first frames):
``first_frame_latents`` (B, C, 1, h, w), the scaled VAE latents of the frame alone, and ``image_embeds``, the SigLIP
tokens of the frame. The first layer gets the text-to-video inputs plus ``condition`` (B, C + 1, F, h, w): those
latents on the first latent frame (zeros after it) and a mask channel that is 1 on that frame, as the pipeline's
``prepare_cond_latents_and_mask`` lays them beside the noisy latents, and the image tokens. The loss covers every
latent frame, as in text-to-video. Images train as 1-frame videos without conditioning (the pipeline's text-to-video
inputs: zero condition, no image tokens). This module imports no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import IMAGE_PROCESSOR, DiffusersFolder
from diffpipe_core.parts.sampling import SampleImageConditioning
from diffpipe_hunyuan.config import HunyuanVideo15I2VConfig
from diffpipe_hunyuan.plugin15 import COMPONENTS, FILE_LAYOUTS, TEXT_COMPONENTS, HunyuanVideo15

if TYPE_CHECKING:
    import torch

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

DESCRIPTION = "HunyuanVideo-1.5 image-to-video (diffusers folder or Tencent's single-file transformer)"


class HunyuanVideo15I2V(SampleImageConditioning, HunyuanVideo15):
    """HunyuanVideo-1.5 image-to-video: clips conditioned on their first frame, images as unconditioned 1-frame
    videos."""
    #: no GPU-fit table (diffpipe_core.engine.fit_table) yet: its first layer's inputs need a first frame encoded by the
    #: VAE and SigLIP, which a config-only folder cannot do (its size is text-to-video's, plugin15.HunyuanVideo15)
    plan_size = None
    tiny_writer = "diffpipe_hunyuan.testing15:write_tiny_hunyuan15_i2v"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(HunyuanVideo15.spec, name="hunyuan-video-1.5-i2v", config_schema=HunyuanVideo15I2VConfig,
                   description=DESCRIPTION, first_frame="optional")
    folder = DiffusersFolder(
        "hunyuan-video-1.5-i2v",
        ("HunyuanVideo15ImageToVideoPipeline",),
        {**COMPONENTS, "image_encoder": "SiglipVisionModel", "feature_extractor": IMAGE_PROCESSOR},
        file_layouts=FILE_LAYOUTS,
        # SigLIP's attention-pooling head: the pipeline reads last_hidden_state, and ComfyUI's clip_vision file
        # (sigclip_vision_patch14_384.safetensors, listed in text_encoders) may lack it
        file_optional={"image_encoder": ("head.",)},
    )
    pipeline_class = "HunyuanVideo15ImageToVideoPipeline"
    encoder_components = (*TEXT_COMPONENTS, "image_encoder", "feature_extractor")

    # ------------------------------------------------------------------------------------------ caching
    def encode_media(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Text-to-video's ``latents`` (and ``mask``), and for clips ``first_frame_latents`` and ``image_embeds`` of
        their first frames, as the pipeline computes them from its ``image``."""
        out = super().encode_media(encoders, batch)
        if batch.first_frames is not None:
            out.update(first_frame_condition(encoders.vae, encoders.image_encoder, encoders.feature_extractor,
                                             batch.first_frames))
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, text_mask, glyph_embeds, glyph_mask[, condition, image_embeds]), (velocity[,
        mask]))``: the conditioning for clips (module docstring), none for images."""
        from diffpipe_core.parts.flow import with_mask

        f = self.noisy(batch, context, generator)
        inputs = (f.x_t, f.t, *self.text_inputs(batch))
        if "first_frame_latents" in batch:
            condition = condition_tensor(batch["first_frame_latents"].float(), f.x_t.shape[2])
            inputs += (condition, batch["image_embeds"].float())
        return inputs, with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """Text-to-video's inputs and ``[model] sample_image``'s ``condition`` and ``image_embeds`` (resized and
        center-cropped to the sample size, the pipeline's ``resize(..., resize_mode="crop")``; computed once per size
        by ``denoise_init``)."""
        cond = self.sample_condition(model_config, request)
        b = latents.shape[0]
        inputs = super().denoise_inputs(latents, schedule, index, text, request, model_config)
        condition = condition_tensor(cond["first_frame_latents"], latents.shape[2]).expand(b, -1, -1, -1, -1)
        return (*inputs, condition, cond["image_embeds"].expand(b, -1, -1))

    def encode_sample_image(self, model_config: HunyuanVideo15I2VConfig, request: SampleRequest) -> dict[str, Any]:
        import torch
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
        from PIL import Image

        from diffpipe_core.parts.encoders import load_components

        spatial = int(self.folder.config(model_config.path, "vae").get("spatial_compression_ratio", 16))
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=spatial, do_resize=False, do_convert_rgb=True)
        with Image.open(model_config.sample_image) as opened:
            image = opened.convert("RGB")
        h, w = request.height // spatial * spatial, request.width // spatial * spatial
        image = processor.resize(image, height=h, width=w, resize_mode="crop")
        pixels = processor.preprocess(image, height=h, width=w)
        enc = load_components(self.folder, model_config, torch.device("cpu"), "vae", "image_encoder",
                              "feature_extractor")
        return first_frame_condition(enc.vae, enc.image_encoder, enc.feature_extractor, pixels.float(), [image])


def first_frame_condition(
    vae: Any, image_encoder: Any, feature_extractor: Any, frames: torch.Tensor, images: list[Any] | None = None
) -> dict[str, torch.Tensor]:
    """``first_frame_latents`` (B, C, 1, h, w): the scaled VAE latents of ``frames`` (B, 3, H, W) in [-1, 1]
    (``_get_image_latents``), and ``image_embeds`` (B, n, d): SigLIP's last hidden state of the frames as PIL
    ``images`` (made from ``frames`` when not given; ``_get_image_embeds``); float32 on CPU."""
    import torch

    from diffpipe_core.parts.images import to_pil_images
    from diffpipe_core.parts.latents import shift_and_scale, vae_mode

    latents = shift_and_scale(vae_mode(vae, frames, video=True), vae.config).cpu()
    param = next(image_encoder.parameters())
    pil = images if images is not None else to_pil_images(frames)
    inputs = feature_extractor.preprocess(images=pil, do_resize=True, return_tensors="pt", do_convert_rgb=True)
    with torch.no_grad():
        embeds = image_encoder(**inputs.to(device=param.device, dtype=param.dtype)).last_hidden_state
    return {"first_frame_latents": latents, "image_embeds": embeds.float().cpu()}


def condition_tensor(first_frame_latents: torch.Tensor, frames: int) -> torch.Tensor:
    """``(B, C + 1, frames, h, w)``: the first-frame latents on latent frame 0 (zeros after it), then a mask channel
    that is 1 on frame 0 (``prepare_cond_latents_and_mask``)."""
    b, c, _, h, w = first_frame_latents.shape
    condition = first_frame_latents.new_zeros(b, c + 1, frames, h, w)
    condition[:, :c, :1] = first_frame_latents[:, :, :1]
    condition[:, c, 0] = 1.0
    return condition


plugin = HunyuanVideo15I2V()
