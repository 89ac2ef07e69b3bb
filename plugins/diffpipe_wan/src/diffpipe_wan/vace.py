"""Wan VACE (entry point ``wan-vace``: ``WanVACETransformer3DModel`` in a ``WanVACEPipeline`` folder, Wan 2.1 VACE
1.3B / 14B), trained on clips paired with control videos.

Each clip of a ``[[directory]]`` pairs with the control video of the same relative path and stem in its
``control_path`` (the core decodes it at the clip's frames and size: ``ModelSpec.control_videos``); the control is
cached as the VACE conditioning ``WanVACEPipeline`` builds of a control video without mask (all ones) or reference
images (:func:`diffpipe_wan.vace_encoding.context`). The first layer gets ``(x_t, t, text_embeds, control)``; the
layers (:mod:`diffpipe_wan.vace_layers`) run the VACE blocks, then the transformer blocks adding their hints. Samples
are conditioned on ``[model] sample_control`` (and ``sample_mask``). This module imports no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, weight_of
from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_wan.config import WanVACEConfig
from diffpipe_wan.control_video import ControlVideoSampling, read_clip
from diffpipe_wan.plugin import COMPONENTS, FILE_LAYOUTS, SIZES, Wan, boundary_ratio

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

CONTROL = "control_0_context"  # the cached VACE conditioning of an item's control video (core.types.control_key)


class WanVACE(ControlVideoSampling, Wan):
    """Wan VACE: clips with control videos (``control_path``); images and clips without a control are refused."""
    plan_size = None  # no GPU-fit table yet: the VACE blocks' memory is not in Wan's plan
    tiny_writer = "diffpipe_wan.testing:write_tiny_wan_vace"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        Wan.spec,
        name="wan-vace",
        config_schema=WanVACEConfig,
        control_images="required",
        control_videos=True,
        description="Wan 2.1 VACE (WanVACEPipeline folder): video-to-video from control videos paired by file name",
        block_layers=("VaceBlockLayer", "VaceTransformerBlockLayer"),
        paired_files=("control_mask", "reference"),
    )
    folder = DiffusersFolder(
        "wan-vace",
        ("WanVACEPipeline",),
        {**COMPONENTS, "transformer": "WanVACETransformer3DModel", "transformer_2": "WanVACETransformer3DModel"},
        sizes=SIZES,
        single_file_example="wan2.1_vace_1.3B_fp16.safetensors",
        file_layouts=FILE_LAYOUTS,
    )
    model_class = "WanVACETransformer3DModel"
    single_file_markers = ("vace_patch_embedding.weight", "vace_blocks.0.self_attn.q.weight")
    # Wan's, and the VACE blocks' count and input channels (vace_layers: the folder's config)
    file_config = {
        **Wan.file_config,
        "vace_in_channels": Shape(weight_of("vace_patch_embedding"), 1),
    }
    key_tables = "diffpipe_wan.vace_original"  # the original VACE layout (ComfyUI's wan2.1_vace_* files)

    def folder_problems(self, model_config: WanVACEConfig) -> list[str]:
        """Wan's, and: a two-expert (Wan 2.2 A14B) VACE folder is not trained yet."""
        found = super().folder_problems(model_config)
        if boundary_ratio(model_config.path) is not None:
            found.append(f"{model_config.path / 'model_index.json'}: a two-expert (Wan 2.2 A14B) VACE folder; wan-vace "
                         "trains Wan 2.1 VACE folders (one WanVACETransformer3DModel) for now")
        return found

    def default_lora_targets(self, model_config: WanVACEConfig) -> list[str]:
        """Wan's (the attention and feed-forward linears of the transformer blocks and of the VACE blocks), and the
        VACE blocks' input projection (block 0's ``proj_in``) and hint projections (``vace_blocks.N.proj_out``; the
        head's ``proj_out`` is not a target)."""
        n = len(self.model_folder_config(model_config).get("vace_layers", ()))
        vace = ["proj_in", *(f"vace_blocks.{i}.proj_out" for i in range(n))]
        return [*super().default_lora_targets(model_config), *vace]

    # ------------------------------------------------------------------------------------------ caching
    def encode_media(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Targets: Wan's ``latents`` (and ``mask``). Control videos (``batch.control_index`` 0): ``context``
        (B, 2z + 64, R + F', h, w), the VACE conditioning (module docstring) of the control video with its mask
        (``batch.control_masks``, ``control_mask_path``; none: all ones) and its R reference images
        (``batch.references``, ``reference_path``), each fitted on a white canvas as ``WanVACEPipeline`` fits them."""
        if batch.control_index is None:
            if batch.pixels.dim() != 5:
                raise ValueError(f"wan-vace trains video clips with control videos; got pixels of shape "
                                 f"{tuple(batch.pixels.shape)} (images)")
            return super().encode_media(encoders, batch)
        from diffpipe_wan import encoding, vace_encoding

        pixels, masks = encoding.fit_to_patches(batch.pixels, batch.control_masks, encoders)
        if pixels.dim() != 5:
            raise ValueError(f"wan-vace control videos must be clips; got pixels of shape {tuple(pixels.shape)}")
        references = None
        if batch.references:
            spatial = int(encoders.vae.config.scale_factor_spatial)
            references = vace_encoding.fit_references(batch.references, *pixels.shape[-2:], spatial).to(pixels)
        return {"context": vace_encoding.context(encoders.vae, pixels, masks, references)}

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: WanVACEConfig) -> list[nn.Module]:
        """Embedders, each VACE block, each transformer block, the head (:mod:`diffpipe_wan.vace_layers`)."""
        from diffpipe_wan.vace_layers import split_into_layers

        return split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, control), (velocity[, mask]))``; all randomness from ``generator``."""
        from diffpipe_core.parts.flow import with_mask

        if CONTROL not in batch:
            raise ValueError("wan-vace: a micro-batch without control videos (every item needs its control_path "
                             "video)")
        import torch

        latents, control = batch["latents"], batch[CONTROL]
        refs = control.shape[2] - latents.shape[2]
        if refs > 0:  # reference frames lead the video: each trains toward its own latent (DiffSynth-Studio's VACE)
            ref = control[:, : latents.shape[1], :refs].to(latents.dtype)
            batch = {**batch, "latents": torch.cat([ref, latents], dim=2)}
        f = self.noisy(batch, context, generator)
        inputs = (f.x_t, f.t, batch["text_embeds"].float(), batch[CONTROL].float())
        return inputs, with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(x_t, t, text_embeds, control)`` with the sample control video's conditioning."""
        from diffpipe_core.sampling.schedules import schedule_time

        control = self.sample_condition(model_config, request)
        b = latents.shape[0]
        t = schedule_time(schedule, index).float().expand(b)
        return latents.float(), t, text["text_embeds"].float(), control.expand(b, -1, -1, -1, -1)

    def encode_sample_control(self, model_config: WanVACEConfig, request: SampleRequest,
                              size: tuple[int, int, int]) -> torch.Tensor:
        """``(1, 2z + 64, R + F', h, w)``: the VACE conditioning of ``[model] sample_control``, ``sample_mask`` and the
        R ``sample_reference`` images (fitted as the pipeline fits its ``reference_images``)."""
        from PIL import Image

        from diffpipe_wan import vace_encoding

        video = read_clip(model_config.sample_control, size, self.spec)[None]
        mask = None
        if model_config.sample_mask is not None:
            mask = ((read_clip(model_config.sample_mask, size, self.spec)[None, :1] + 1) / 2).clamp(0, 1)
        vae = self.sample_vae(model_config)
        references = None
        if sample_references(model_config):
            images = []
            for file in sample_references(model_config):
                with Image.open(file) as opened:
                    images.append(opened.convert("RGB"))
            spatial = int(vae.config.scale_factor_spatial)
            references = vace_encoding.fit_references([tuple(images)], size[1], size[0], spatial)
        return vace_encoding.context(vae, video, mask, references)

    def sample_shape(self, shape: tuple[int, ...], model_config: WanVACEConfig) -> tuple[int, ...]:
        """One more latent frame in front for each ``sample_reference`` image (the pipeline's ``num_frames + R *
        temporal``), which :meth:`decode_latents` drops again."""
        self._trim = len(sample_references(model_config))  # the sample's reference frames, dropped when decoding
        return (*shape[:2], shape[2] + self._trim, *shape[3:])

    @hookimpl
    def decode_latents(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """Wan's decoding of the latents after the reference frames (``WanVACEPipeline`` drops them likewise)."""
        return super().decode_latents(decoder, latents[:, :, getattr(self, "_trim", 0):])


def sample_references(model_config: WanVACEConfig) -> list[Any]:
    """``[model] sample_reference`` as a list of files (empty without)."""
    value = model_config.sample_reference
    return [] if value is None else list(value) if isinstance(value, list) else [value]


wan_vace = WanVACE()
