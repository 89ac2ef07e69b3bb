"""Wan first-last-frame-to-video (entry point ``wan-flf2v``: Wan 2.1 FLF2V 14B, Wan 2.2 I2V A14B given a last frame),
as ``WanImageToVideoPipeline`` runs it with ``image`` and ``last_image``.

Everything is ``wan-i2v``'s (:mod:`diffpipe_wan.i2v`) with the clip's last frame as a second condition. The core
hands ``encode_batch`` each clip with its first frame; the last frame is the clip's own last frame (the last of the
frames the clip's frame bucket keeps), so the conditions are the clip's two ends, as first-last-frame training data
is made. Cached: ``first_frame_latents``, the normalised VAE latents of ``[first frame, zeros, ..., last frame]``, and
for Wan 2.1 FLF2V ``image_embeds`` ``(B, 2n, d)``, CLIP's penultimate hidden states of the first and the last frame
side by side (the pipeline's ``encode_image([image, last_image])``; the transformer's image embedder adds its
``pos_embed`` over both). The mask channels mark the first latent frame and the last pixel frame as given. Samples
are generated from ``[model] sample_image`` and ``sample_last_image``. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_wan.config import WanI2VConfig
from diffpipe_wan.i2v import WanI2V
from diffpipe_wan.plugin import COMPONENTS, FILE_LAYOUTS, SIZES


class WanFLF2VConfig(WanI2VConfig):
    """``[model]`` keys of Wan first-last-frame-to-video (``WanImageToVideoPipeline`` folders: Wan 2.1 FLF2V 14B with
    its CLIP vision encoder, Wan 2.2 I2V A14B)."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers",
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    )

    sample_last_image: Path | None = Field(
        None,
        description="The last frame every sample during training (and `diffpipe sample`) ends on, with sample_image "
        "its first; required for [sample]. Resized to the sample size as WanImageToVideoPipeline resizes last_image.",
    )


class WanFLF2V(WanI2V):
    """Wan first-last-frame-to-video: clips only, each conditioned on its first and last frame."""

    last_frame = True
    tiny_writer = "diffpipe_wan.testing:write_tiny_wan_flf2v"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        WanI2V.spec,
        name="wan-flf2v",
        config_schema=WanFLF2VConfig,
        description="Wan 2.1 FLF2V / Wan 2.2 I2V A14B first-last-frame-to-video (diffusers folder or original single "
        "file; A14B experts)",
        paired_files=("last_frame",),
    )
    folder = DiffusersFolder(
        "wan-flf2v",
        ("WanImageToVideoPipeline",),
        COMPONENTS,
        sizes=SIZES,
        single_file_example="wan2.1_flf2v_720p_14B_fp16.safetensors",
        file_layouts=FILE_LAYOUTS,
    )

    def folder_problems(self, model_config: WanFLF2VConfig) -> list[str]:
        """``wan-i2v``'s, and: a transformer with CLIP image embeddings must be a first-last-frame one (its image
        embedder's ``pos_embed`` over two images: Wan 2.1 FLF2V, not Wan 2.1 I2V)."""
        found = super().folder_problems(model_config)
        config = self.model_folder_config(model_config)
        if config.get("image_dim") is not None and config.get("pos_embed_seq_len") is None:
            source = model_config.diffusion_model or model_config.path / self.model_component(model_config)
            found.append(
                f"{source}: this Wan 2.1 image-to-video transformer takes one image (its image embedder has no "
                "pos_embed / img_emb.emb_pos for a first and a last frame): it is Wan 2.1 I2V, train it with [model] "
                "type = \"wan-i2v\"; wan-flf2v takes Wan 2.1 FLF2V (pos_embed_seq_len in its config) or Wan 2.2 I2V "
                "A14B"
            )
        return found

    def sample_images(self, model_config: WanFLF2VConfig) -> list[Path]:
        """``[model] sample_image`` and ``sample_last_image``: the first and the last frame of every sample."""
        first = super().sample_images(model_config)
        if model_config.sample_last_image is None:
            raise ValueError(
                "wan-flf2v samples are generated from a first and a last frame: set [model] sample_last_image to an "
                "image file (sample_image is the first)"
            )
        return [*first, model_config.sample_last_image]


wan_flf2v = WanFLF2V()
