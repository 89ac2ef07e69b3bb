"""Wan image-to-video (entry point ``wan-i2v``: Wan 2.1 I2V 14B, Wan 2.2 I2V A14B), as ``WanImageToVideoPipeline``
runs it.

Each clip is cached with its first frame's conditioning (the core hands ``encode_batch`` the clips' first frames):
``first_frame_latents``, the normalised VAE latents of ``[first frame, zeros, ...]``, and for Wan 2.1 the CLIP vision
embedding ``image_embeds``. The first layer gets ``(x, t, text_embeds[, image_embeds])`` where ``x`` is the noisy
latents, the first-frame mask (4 channels) and ``first_frame_latents`` along the channels, in the pipeline's order;
the loss covers every latent frame. Images cannot train it (the core refuses them). Everything else (files, layouts,
layers, exports, A14B experts) is Wan's. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_wan.config import WanI2VConfig
from diffpipe_wan.plugin import COMPONENTS, FILE_LAYOUTS, SIZES, Wan, _folder_facts, sampling_timestep

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

TEXT_TOKENS = 512  # diffusers' WanAttnProcessor takes the last 512 context tokens as the text (the rest: the image)


class WanI2V(Wan):
    """Wan image-to-video: clips only, each conditioned on its first frame."""
    #: no GPU-fit table (diffpipe_core.engine.fit_table) yet: its first layer's inputs need a first frame encoded by the
    #: VAE and CLIP, which a config-only folder cannot do (its blocks are Wan 14B's plus the image cross-attention)
    plan_size = None
    last_frame = False  # conditioned on the clip's last frame too (diffpipe_wan.flf2v)
    tiny_writer = "diffpipe_wan.testing:write_tiny_wan_i2v"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        Wan.spec,
        name="wan-i2v",
        config_schema=WanI2VConfig,
        first_frame="required",
        description="Wan 2.1 / 2.2 image-to-video (diffusers folder or original single-file transformer; A14B experts)",
    )
    folder = DiffusersFolder(
        "wan-i2v",
        ("WanImageToVideoPipeline",),
        COMPONENTS,
        sizes=SIZES,
        single_file_example="wan2.1_i2v_480p_14B_fp16.safetensors",
        file_layouts=FILE_LAYOUTS,
    )

    def __init__(self) -> None:
        self._conditions: dict[tuple, dict[str, torch.Tensor]] = {}  # sample conditioning, per image and size

    def folder_problems(self, model_config: WanI2VConfig) -> list[str]:
        """Wan's, and: a Wan 2.2 TI2V folder (its image-to-video replaces the first latent frame) is not this model;
        a Wan 2.1 I2V transformer attends to exactly 512 text tokens."""
        found = super().folder_problems(model_config)
        if _folder_facts(str(model_config.path))["index"].get("expand_timesteps"):
            found.append(
                f"{model_config.path / 'model_index.json'}: expand_timesteps is set: a Wan 2.2 TI2V folder, whose "
                "image-to-video keeps the first latent frame clean instead of conditioning on it; train that with "
                "[model] type = \"wan-ti2v\" (text-to-video: \"wan\"), wan-i2v takes WanImageToVideoPipeline "
                "folders of Wan 2.1 / 2.2 I2V"
            )
        config = self.model_folder_config(model_config)
        if config.get("image_dim") is not None and model_config.text_max_length != TEXT_TOKENS:
            found.append(
                f"{model_config.path / self.model_component(model_config) / 'config.json'}: this Wan 2.1 image-to-"
                f"video transformer attends to exactly {TEXT_TOKENS} text tokens after the image's (diffusers' "
                f"WanAttnProcessor cuts the context there); set [model] text_max_length = {TEXT_TOKENS} (now "
                f"{model_config.text_max_length})"
            )
        return found

    def image_encoder(self, model_config: WanI2VConfig) -> bool:
        """Whether the trained transformer takes CLIP vision embeddings (Wan 2.1 I2V; Wan 2.2's does not)."""
        return self.model_folder_config(model_config).get("image_dim") is not None

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: WanI2VConfig, device: torch.device) -> Any:
        """Wan's VAE and UMT5, and for a transformer with image embeddings the CLIP vision encoder and its image
        processor."""
        from diffpipe_core.parts.encoders import load_components

        enc = super().load_encoders(model_config, device)
        enc.image_encoder = enc.image_processor = None
        if self.image_encoder(model_config):
            vision = load_components(self.folder, model_config, device, "image_encoder", "image_processor")
            enc.image_encoder, enc.image_processor = vision.image_encoder, vision.image_processor
        return enc

    def encode_media(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Wan's ``latents`` (and ``mask``) of the clips, ``first_frame_latents`` (B, z, F', h, w) and, for Wan 2.1,
        ``image_embeds`` (B, n, d) of their first frames, as ``WanImageToVideoPipeline`` computes them from its
        ``image``; ``wan-flf2v`` also of the last frames, the clips' own or ``last_frame_path``'s images
        (``batch.last_frames``, resized as the pipeline resizes its ``last_image``)."""
        import torch

        from diffpipe_wan import encoding

        if batch.pixels.dim() != 5 or batch.first_frames is None:
            raise ValueError(
                f"wan-i2v encodes video clips with their first frames; got pixels of shape {tuple(batch.pixels.shape)}"
                f" and {'no ' if batch.first_frames is None else ''}first frames"
            )
        if self.last_frame and batch.pixels.shape[2] < 2:
            raise ValueError(
                f"{self.spec.name} encodes clips with a first and a last frame; got clips of {batch.pixels.shape[2]} "
                "frame: give the dataset frame_buckets of 5 frames or more"
            )
        last = batch.pixels[:, :, -1] if self.last_frame else None
        pixels, masks, first, last = encoding.fit_to_patches(batch.pixels, batch.masks, encoders, batch.first_frames,
                                                             last)  # fmt: skip
        last_images = None if last is None else encoding.to_images(last)
        if self.last_frame and batch.last_frames is not None:  # last_frame_path: images of their own, at their size
            last_images = [encoding.to_images(f[None])[0] for f in batch.last_frames]
            spatial = int(encoders.vae.config.scale_factor_spatial)
            last = torch.cat([encoding.pipeline_pixels(im, *pixels.shape[-2:], spatial) for im in last_images])
        out = super().encode_media(encoders, replace(batch, pixels=pixels, masks=masks))
        out["first_frame_latents"] = encoding.first_frame_latents(encoders.vae, first, pixels.shape[2],
                                                                  None if last is None else last.to(first))
        if encoders.image_encoder is not None:
            images = [encoding.to_images(first), last_images]
            out["image_embeds"] = encoding.clip_embeds(encoders.image_encoder, encoders.image_processor, *images)
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x, t, text_embeds[, image_embeds]), (velocity[, mask]))``, ``x`` = noisy latents | first-frame mask |
        first-frame latents (module docstring), and each sample's expert with ``expert = "both"``; all randomness from
        ``generator``."""
        import torch

        from diffpipe_core.parts.flow import with_mask
        from diffpipe_wan.encoding import first_frame_mask

        f = self.noisy(batch, context, generator)
        b, _, frames, h, w = f.x_t.shape
        mask = first_frame_mask(b, frames, h, w, self.temporal(context.model_config), self.last_frame)
        x = torch.cat([f.x_t, mask, batch["first_frame_latents"].float()], dim=1)
        image = (batch["image_embeds"].float(),) if "image_embeds" in batch else ()
        inputs = self.with_expert((x, f.t, batch["text_embeds"].float(), *image), f.t, context.model_config)
        return inputs, with_mask((f.target,), batch)

    def temporal(self, model_config: WanI2VConfig) -> int:
        """The VAE's temporal compression (pixel frames per latent frame)."""
        return int(self.folder.config(model_config.path, "vae").get("scale_factor_temporal", 4))

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: WanI2VConfig, generator: torch.Generator):
        """Wan's noise and schedule; the conditioning on ``[model] sample_image`` is computed here once per size
        (the VAE, and CLIP for Wan 2.1, loaded on the host for it)."""
        self.sample_condition(model_config, request)
        return super().denoise_init(request, model_config, generator)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x, t, text_embeds[, image_embeds])`` with the sample image's conditioning (``t`` as
        :meth:`Wan.denoise_inputs` gives it)."""
        import torch

        from diffpipe_core.sampling.schedules import schedule_time

        cond = self.sample_condition(model_config, request)
        b = latents.shape[0]
        x = torch.cat([latents.float(), cond["condition"].expand(b, -1, -1, -1, -1)], dim=1)
        image = (cond["image_embeds"].expand(b, -1, -1),) if "image_embeds" in cond else ()
        t = schedule_time(schedule, index).float().expand(b)
        return self.with_expert((x, t, text["text_embeds"].float(), *image), t, model_config,
                                sampling_timestep(schedule, index))

    def sample_condition(self, model_config: WanI2VConfig, request: SampleRequest) -> dict[str, torch.Tensor]:
        """``condition`` (1, 4 + z, F', h, w): the first-frame mask and latents of ``[model] sample_image`` resized to
        the sample size (``WanImageToVideoPipeline.prepare_latents``), and ``image_embeds`` of the image for Wan 2.1
        (``encode_image``); cached per image and size."""
        files = tuple(map(str, self.sample_images(model_config)))
        key = (str(model_config.path), files, request.width, request.height, request.frames)
        if key not in self._conditions:
            self._conditions[key] = self._encode_sample_image(model_config, request)
        return self._conditions[key]

    def _encode_sample_image(self, model_config: WanI2VConfig, request: SampleRequest) -> dict[str, torch.Tensor]:
        import torch

        from diffpipe_core.parts.encoders import load_components
        from diffpipe_wan import encoding

        vae_config = self.folder.config(model_config.path, "vae")
        _, _, frames, h, w = encoding.latent_shape(vae_config, self.model_folder_config(model_config), request)
        images, pixels = zip(*encoding.sample_images(self.sample_images(model_config), vae_config, h, w), strict=True)
        names = ("vae", "image_encoder", "image_processor") if self.image_encoder(model_config) else ("vae",)
        enc = load_components(self.folder, model_config, torch.device("cpu"), *names)
        temporal = int(vae_config.get("scale_factor_temporal", 4))
        with torch.no_grad():
            latents = encoding.first_frame_latents(enc.vae, pixels[0], temporal * (frames - 1) + 1, *pixels[1:])
        mask = encoding.first_frame_mask(1, frames, h, w, temporal, self.last_frame)
        out = {"condition": torch.cat([mask, latents], dim=1)}
        if len(names) > 1:
            out["image_embeds"] = encoding.clip_embeds(enc.image_encoder, enc.image_processor, list(images[:1]),
                                                       list(images[1:]) or None)  # fmt: skip
        return out

    def sample_images(self, model_config: WanI2VConfig) -> list[Path]:
        """The images samples are conditioned on: ``[model] sample_image`` (the first frame)."""
        if model_config.sample_image is None:
            raise ValueError(
                f"{self.spec.name} samples are generated from a first frame: set [model] sample_image to an image file"
            )
        return [model_config.sample_image]


wan_i2v = WanI2V()
