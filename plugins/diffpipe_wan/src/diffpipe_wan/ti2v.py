"""Wan 2.2 TI2V 5B image-to-video (entry point ``wan-ti2v``), as ``WanImageToVideoPipeline`` runs a TI2V folder
(``expand_timesteps`` in ``model_index.json``): no mask or condition channels and no CLIP, the first latent frame
*is* the given image's latents, at time 0.

Training (the core's :func:`~diffpipe_core.diffusion.first_frame_conditioning`, as LTX-Video trains image-to-video):
each clip's first latent frame stays clean with probability ``first_frame_conditioning_p`` (default 1: every clip),
its tokens get time 0 and the loss leaves it out; the other frames are noised as in any Wan run. The clean frame is
the clip's own first latent frame: the Wan VAE encodes the first pixel frame alone (its causal first chunk), so that
frame equals the pipeline's ``latent_condition`` of the image alone. The first layer gets ``(x, t, text_embeds)``
with ``t`` one time per video token ``(B, F'·h'·w')``, as the pipeline builds its ``timestep`` from
``first_frame_mask[0][0][:, ::2, ::2] * t``. Images (one latent frame) train text-to-image as ``wan`` does.

Samples: with ``[model] sample_image`` its latents replace the first latent frame in every step's input (time 0
there) and in the final latents, as the pipeline does; without it, text-to-video with per-token times (what
``WanPipeline`` does on a TI2V folder). Everything else (files, layouts, layers, exports) is Wan's. This module
imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_core.parts.plugin import diffusers_spec
from diffpipe_core.parts.sampling import SampleImageConditioning
from diffpipe_wan.config import WanConfig
from diffpipe_wan.plugin import COMPONENTS, FILE_LAYOUTS, SIZES, Wan, _folder_facts

if TYPE_CHECKING:
    import torch

    from diffpipe_core import TrainingContext
    from diffpipe_core.types import SampleRequest


class WanTI2VConfig(WanConfig):
    """``[model]`` keys of Wan 2.2 TI2V image-to-video (a ``Wan2.2-TI2V-5B-Diffusers`` folder)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Wan-AI/Wan2.2-TI2V-5B-Diffusers",)

    first_frame_conditioning_p: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Probability that a clip's first latent frame stays clean (time 0, the given image as "
        "WanImageToVideoPipeline keeps it) and is left out of the loss; 1 trains image-to-video only, lower values "
        "mix in text-to-video (TI2V trains both). Images (one latent frame) are never conditioned.",
    )
    sample_image: Path | None = Field(
        None,
        description="The first frame samples during training (and `diffpipe sample`) start from, resized to the "
        "sample size as WanImageToVideoPipeline does; without it samples are text-to-video.",
    )


class WanTI2V(SampleImageConditioning, Wan):
    """Wan 2.2 TI2V 5B image-to-video: the first latent frame clean, a time per token."""

    tiny_writer = "diffpipe_wan.testing:write_tiny_wan_ti2v"  # python -m diffpipe_core.testing.tiny_models
    #: the released size (Wan 2.2 TI2V 5B) for the model page's GPU-fit table (diffpipe_core.engine.fit_table); its
    #: first layer's inputs come from text-to-video sampling (no sample image), with per-token times as in training
    plan_size = {
        **Wan.plan_size,
        "transformer": {**Wan.plan_size["transformer"], "num_attention_heads": 24, "in_channels": 48,
                        "out_channels": 48, "ffn_dim": 14336, "num_layers": 30},
        "vae": {"z_dim": 48, "scale_factor_spatial": 16, "scale_factor_temporal": 4},
    }  # fmt: skip

    spec = diffusers_spec(
        "wan-ti2v", WanTI2VConfig,
        "Wan 2.2 TI2V 5B image-to-video (first latent frame clean, per-token times; diffusers folder or single file)",
        video=(4, 1, 16.0), encoder_settings=("text_max_length",), block_layers=("BlockLayer",),
    )  # fmt: skip
    folder = DiffusersFolder(
        "wan-ti2v",
        ("WanPipeline", "WanImageToVideoPipeline"),
        COMPONENTS,
        sizes=SIZES,
        single_file_example="wan2.2_ti2v_5B_fp16.safetensors",
        file_layouts=FILE_LAYOUTS,
    )

    def folder_problems(self, model_config: WanTI2VConfig) -> list[str]:
        """Only a TI2V folder (``expand_timesteps``) has this image-to-video."""
        if _folder_facts(str(model_config.path))["index"].get("expand_timesteps"):
            return []
        return [
            f"{model_config.path / 'model_index.json'}: expand_timesteps is not set: not a Wan 2.2 TI2V folder; "
            "wan-ti2v trains TI2V 5B's image-to-video (its first latent frame kept clean); train Wan 2.1 / 2.2 I2V "
            "folders with [model] type = \"wan-i2v\" and text-to-video with \"wan\""
        ]

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x, t, text_embeds), (velocity, loss weight))``: ``x`` the noisy latents with a conditioned clip's
        first latent frame clean, ``t`` ``(B, L)`` per video token (0 on that frame), the weight 0 there (times the
        dataset's mask); all randomness from ``generator``."""
        from diffpipe_core.diffusion import first_frame_conditioning

        cfg: WanTI2VConfig = context.model_config  # type: ignore[assignment]
        f = self.noisy(batch, context, generator)
        latents = batch["latents"].float()
        cond = first_frame_conditioning(latents, f.x_t, f.t, cfg.first_frame_conditioning_p, generator,
                                        evaluating=context.eval_quantile is not None)  # fmt: skip
        weight = cond.weight if "mask" not in batch else cond.weight * batch["mask"].float()
        t = token_times(cond.frame_t, latents.shape, self.patch(cfg))
        return (cond.x_t, t, batch["text_embeds"].float()), (f.target, weight)

    def patch(self, model_config: WanTI2VConfig) -> tuple[int, int, int]:
        """The transformer's ``patch_size``."""
        return tuple(self.model_folder_config(model_config).get("patch_size", (1, 2, 2)))

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: WanTI2VConfig, generator: torch.Generator):
        """Wan's noise and schedule; with ``[model] sample_image`` the noise's first latent frame replaced by the
        image's latents (computed here once per size)."""
        latents, schedule = Wan.denoise_init(self, request, model_config, generator)
        if model_config.sample_image is not None:
            latents[:, :, :1] = self.sample_condition(model_config, request)["latents"]
        return latents, schedule

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(x, t, text_embeds)``: the latents (with a sample image: its latents as the first frame), the step's time
        on every token (0 on the image's), as ``WanImageToVideoPipeline`` with ``expand_timesteps``."""
        from diffpipe_core.sampling.schedules import schedule_time

        b, _, frames = latents.shape[:3]
        frame_t = schedule_time(schedule, index).float().expand(b, frames).clone()
        if model_config.sample_image is not None:
            frame_t[:, 0] = 0.0
        x = latents.float()
        return x, token_times(frame_t, x.shape, self.patch(model_config)), text["text_embeds"].float()

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """The folder scheduler's step on all latents (as the pipeline steps them), the first frame then kept as the
        sample image's. Its elementwise steps make every other frame what the pipeline computes (whose own first
        frame drifts but is replaced in each input and in the final latents)."""
        stepped = super().denoise_step(latents, prediction, schedule, index, model_config)
        if model_config.sample_image is not None:
            stepped[:, :, :1] = latents[:, :, :1].to(stepped.dtype)
        return stepped

    def encode_sample_image(self, model_config: WanTI2VConfig, request: SampleRequest) -> dict[str, Any]:
        """``latents`` (1, z, 1, h, w): ``[model] sample_image`` resized to the sample size, encoded alone and
        normalised (``WanImageToVideoPipeline.prepare_latents`` with ``expand_timesteps``)."""
        import torch

        from diffpipe_core.parts.encoders import load_components
        from diffpipe_wan import encoding

        vae_config = self.folder.config(model_config.path, "vae")
        _, _, _, h, w = encoding.latent_shape(vae_config, self.model_folder_config(model_config), request)
        (_, pixels), = encoding.sample_images([model_config.sample_image], vae_config, h, w)  # fmt: skip
        vae = load_components(self.folder, model_config, torch.device("cpu"), "vae").vae
        with torch.no_grad():
            return {"latents": encoding.latents(vae, pixels)}


def token_times(frame_t: torch.Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    """``(B, F'·h'·w')``: each latent frame's time ``frame_t`` ``(B, F)`` on each of its tokens (latents of ``shape``
    ``(B, C, F, h, w)`` in ``patch``-sized tokens, frame-major as the transformer orders them)."""
    _, _, frames, h, w = shape
    per_frame = (h // patch[1]) * (w // patch[2])
    return frame_t[:, :: patch[0]].repeat_interleave(per_frame, dim=1)


wan_ti2v = WanTI2V()
