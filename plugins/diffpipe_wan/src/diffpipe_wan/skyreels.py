"""SkyReels V2 (entry points ``skyreels-v2``: text-to-video and diffusion forcing; ``skyreels-v2-i2v``: image-to-video),
a Wan 2.1 transformer (``SkyReelsV2Transformer3DModel``) with its own time embedding, per-frame times and
block-causal attention, trained as its diffusers pipelines run it.

Everything but the transformer is Wan's (VAE, UMT5, the caching, the image-to-video conditioning, the original
single-file layout, the exports): the classes here are :class:`~diffpipe_wan.plugin.Wan` and
:class:`~diffpipe_wan.i2v.WanI2V` with SkyReels' transformer, folders and layers (:mod:`diffpipe_wan.skyreels_layers`).
Diffusion forcing (a ``SkyReelsV2DiffusionForcingPipeline`` folder, or ``[model] diffusion_forcing = true``) draws
one time per latent frame and samples as that pipeline does (:mod:`diffpipe_wan.skyreels_df`). This module imports
no torch, diffusers or transformers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_wan.config import WanConfig, WanI2VConfig
from diffpipe_wan.i2v import WanI2V
from diffpipe_wan.plugin import COMPONENTS, FILE_LAYOUTS, SIZES, Wan, _folder_facts

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import TrainingContext
    from diffpipe_core.types import ModelSpec, SampleRequest

FPS = 24.0  # SkyReels V2 generates 24 fps video (its pipelines' examples; the DF pipeline's fps default)
T2V, DF, I2V = "SkyReelsV2Pipeline", "SkyReelsV2DiffusionForcingPipeline", "SkyReelsV2ImageToVideoPipeline"
SKYREELS_COMPONENTS = {**COMPONENTS, "transformer": "SkyReelsV2Transformer3DModel"}
SKYREELS_COMPONENTS.pop("transformer_2")
PLAN_TRANSFORMER = {  # SkyReels-V2-T2V-14B / DF-14B: Wan 2.1 14B's transformer
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
}  # fmt: skip


class SkyReelsConfig(WanConfig):
    """``[model]`` keys of SkyReels V2 text-to-video and diffusion forcing: Wan's (``expert`` does not apply) and
    the diffusion-forcing ones."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers",
        "Skywork/SkyReels-V2-T2V-14B-720P-Diffusers",
        "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers",
        "Skywork/SkyReels-V2-DF-14B-540P-Diffusers",
        "Skywork/SkyReels-V2-DF-14B-720P-Diffusers",
    )

    diffusion_forcing: bool | None = Field(
        None,
        description="Train with one time per latent frame (diffusion forcing: FoPP-drawn, non-decreasing along the "
        "clip, shared within a causal block) and sample as SkyReelsV2DiffusionForcingPipeline. Default: on for a "
        "SkyReelsV2DiffusionForcingPipeline folder, off for a SkyReelsV2Pipeline one (one time per clip).",
    )
    causal_block_size: int | None = Field(
        None,
        ge=1,
        description="Diffusion forcing: latent frames per causal block (one time per block; above 1 each block also "
        "attends only to itself and earlier blocks, the pipeline's causal_block_size). Default: the transformer's "
        "num_frame_per_block (1 in the released folders).",
    )
    ar_step: int = Field(
        0,
        ge=0,
        description="Diffusion-forcing samples: the pipeline's ar_step (0: every frame denoised together; above 0: "
        "each causal block lags the previous one by ar_step steps).",
    )


class SkyReelsI2VConfig(WanI2VConfig):
    """``[model]`` keys of SkyReels V2 image-to-video (``SkyReelsV2ImageToVideoPipeline`` folders)."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "Skywork/SkyReels-V2-I2V-1.3B-540P-Diffusers",
        "Skywork/SkyReels-V2-I2V-14B-540P-Diffusers",
        "Skywork/SkyReels-V2-I2V-14B-720P-Diffusers",
    )


def pipeline_class(model_config: WanConfig) -> str | None:
    """The folder's pipeline class (``model_index.json``'s ``_class_name``)."""
    return _folder_facts(str(model_config.path))["index"].get("_class_name")


def entry_point(base: ModelSpec, name: str, schema: type, pipelines: tuple[str, ...], what: str, example: str):
    """``(spec, folder)`` of a SkyReels V2 entry point: ``base`` (Wan's spec) renamed, at 24 fps, and a folder of
    ``pipelines`` with SkyReels' transformer."""
    spec = replace(base, name=name, config_schema=schema, video_fps=FPS, block_layers=("BlockLayer",),
                   description=f"SkyReels V2 {what} (diffusers folder or original single file)")  # fmt: skip
    folder = DiffusersFolder(name, pipelines, SKYREELS_COMPONENTS, sizes=SIZES, file_layouts=FILE_LAYOUTS,
                             single_file_example=f"{example} transformer in the Wan layout (.safetensors)")  # fmt: skip
    return spec, folder


class SkyReelsLayers:
    """Mixin: SkyReels' transformer class, key table and pipeline layers over a Wan entry point."""

    model_class = "SkyReelsV2Transformer3DModel"
    key_tables = "diffpipe_wan.skyreels_keys"

    def frames_per_block(self, model_config: WanConfig) -> int:
        """The causal block size: ``[model] causal_block_size`` or the transformer's ``num_frame_per_block``."""
        given = getattr(model_config, "causal_block_size", None)
        return int(given or self.model_folder_config(model_config).get("num_frame_per_block", 1))

    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: WanConfig) -> list[nn.Module]:
        """Embedders (patch, time per sample or per frame, text, image, frame rate, rotary), each transformer block
        (block-causal with a causal block size above 1), the head."""
        from diffpipe_wan.skyreels_layers import split_into_layers

        return split_into_layers(model, self.spec.video_fps, self.frames_per_block(model_config))


class SkyReelsV2(SkyReelsLayers, Wan):
    """SkyReels V2 text-to-video (one time per clip) and diffusion forcing (one time per latent frame); 24 fps."""

    tiny_writer = "diffpipe_wan.skyreels_testing:write_tiny_skyreels"
    spec, folder = entry_point(Wan.spec, "skyreels-v2", SkyReelsConfig, (T2V, DF),
                               "text-to-video and diffusion forcing", "SkyReels-V2-DF-1.3B-540P")  # fmt: skip
    plan_size = {
        **Wan.plan_size,
        "transformer": PLAN_TRANSFORMER,
        "scheduler": {**Wan.plan_size["scheduler"], "flow_shift": 8.0},
    }

    def forcing(self, model_config: SkyReelsConfig) -> bool:
        """Whether the run is diffusion forcing: ``[model] diffusion_forcing``, else a DF pipeline folder."""
        if model_config.diffusion_forcing is not None:
            return model_config.diffusion_forcing
        return pipeline_class(model_config) == DF

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """Text-to-video: Wan's ``((x_t, t, text_embeds), (velocity[, mask]))``. Diffusion forcing: ``t`` is
        ``(B, F')``, each latent frame noised to its own time (:func:`diffpipe_wan.skyreels_df.frame_times`); the
        noise first, then the times, all from ``generator``."""
        cfg: SkyReelsConfig = context.model_config  # type: ignore[assignment]
        if not self.forcing(cfg):
            return super().prepare_inputs(batch, context, generator)
        import torch

        from diffpipe_core.parts.flow import with_mask
        from diffpipe_wan.skyreels_df import frame_flow_pair, frame_times

        latents = batch["latents"].float()
        noise = torch.randn(latents.shape, generator=generator)
        shift, time_range = self.flow_settings(cfg)
        b, frames = latents.shape[0], latents.shape[2]
        t = frame_times(b, frames, self.frames_per_block(cfg), cfg, shift, time_range, generator,
                        context.eval_quantile)  # fmt: skip
        x_t, target = frame_flow_pair(latents, noise, t)
        return (x_t, t, batch["text_embeds"].float()), with_mask((target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: SkyReelsConfig, generator: torch.Generator):
        """Text-to-video: Wan's. Diffusion forcing: the same noise, and the pipeline's timestep matrix with one copy
        of the folder's scheduler per latent frame (:func:`diffpipe_wan.skyreels_df.forcing_schedule`)."""
        latents, schedule = super().denoise_init(request, model_config, generator)
        if not self.forcing(model_config):
            return latents, schedule
        from diffpipe_wan.skyreels_df import forcing_schedule

        scheduler = schedule.diffpipe_scheduler
        frames = latents.shape[2]
        return latents, forcing_schedule(scheduler, request.steps, frames, model_config.ar_step,
                                         self.frames_per_block(model_config))  # fmt: skip

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """Wan's ``(x_t, t, text_embeds)``; under diffusion forcing ``t`` is the matrix's row, per latent frame."""
        from diffpipe_wan.skyreels_df import forcing_of, forcing_times

        forcing = forcing_of(schedule)
        if forcing is None:
            return super().denoise_inputs(latents, schedule, index, text, request, model_config)
        t = forcing_times(forcing, index, latents.shape[0])
        return latents.float(), t, text["text_embeds"].float()

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """The folder scheduler's step; under diffusion forcing each frame's own scheduler where the pipeline steps
        it."""
        from diffpipe_wan.skyreels_df import forcing_of, forcing_step

        forcing = forcing_of(schedule)
        if forcing is None:
            return super().denoise_step(latents, prediction, schedule, index, model_config)
        return forcing_step(forcing, latents, prediction, index)


class SkyReelsV2I2V(SkyReelsLayers, WanI2V):
    """SkyReels V2 image-to-video: Wan 2.1 I2V's first-frame conditioning and CLIP embedding, SkyReels' transformer."""

    tiny_writer = "diffpipe_wan.skyreels_testing:write_tiny_skyreels_i2v"
    spec, folder = entry_point(WanI2V.spec, "skyreels-v2-i2v", SkyReelsI2VConfig, (I2V,), "image-to-video",
                               "SkyReels-V2-I2V-14B-540P")  # fmt: skip

skyreels_v2 = SkyReelsV2()
skyreels_v2_i2v = SkyReelsV2I2V()
