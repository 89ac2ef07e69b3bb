"""The video-to-world side of the Cosmos plugins (``[model] conditioning = "video"``): checks, and the sampling
conditioning of ``[model] sample_video`` as ``CosmosVideoToWorldPipeline`` / ``Cosmos2VideoToWorldPipeline`` build
and use it. A mixin of :class:`diffpipe_cosmos.plugin.Cosmos`; the maths is in :mod:`diffpipe_cosmos.video2world`.
This module imports no torch (the plugin module imports it at start-up); each method imports what does the work.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from diffpipe_core.types import SampleRequest
    from diffpipe_cosmos.config import CosmosConfigBase


class VideoToWorld:
    """Video-to-world checks and sampling; the plugin gives ``variant``, ``folder``, ``vae_factors``,
    ``sigma_data`` and ``model_folder_config``."""

    def __init__(self) -> None:
        super().__init__()
        self._sampling: dict[int, tuple[torch.Tensor, Any]] = {}  # each running sample's conditioning, by schedule
        self._posteriors: dict[tuple, tuple[Any, int]] = {}  # the sample video's VAE posterior, per file and size

    def conditioned(self, model_config: CosmosConfigBase) -> bool:
        """Video-to-world (``[model] conditioning = "video"``; a subclass's table without the key: text-to-world)."""
        return getattr(model_config, "conditioning", "text") == "video"

    def conditioning_problems(self, model_config: CosmosConfigBase) -> list[str]:
        """``conditioning = "video"`` with a text-to-world transformer (no condition-mask channel), or a missing
        ``sample_video``."""
        if not self.conditioned(model_config):
            return []
        found = []
        config = self.model_folder_config(model_config)  # type: ignore[attr-defined]
        channels = int(config.get("in_channels", 16)), int(config.get("out_channels", 16))
        if channels[0] != channels[1] + 1:
            found.append(
                f"{model_config.path / self.model_component(model_config) / 'config.json'}: [model] conditioning = "  # type: ignore[attr-defined]
                f'"video" needs a video-to-world transformer (in_channels = out_channels + 1, the condition mask); '
                f"this one has in_channels {channels[0]}, out_channels {channels[1]}: a text-to-world model, train it "
                'with conditioning = "text"'
            )
        video = model_config.sample_video
        if video is not None and not Path(video).is_file():
            found.append(f"[model] sample_video: file not found: {video}")
        return found

    def start_conditioned(
        self, sigmas: torch.Tensor, model_config: CosmosConfigBase, request: SampleRequest, generator: torch.Generator
    ) -> None:
        """For a video-to-world sample: its conditioning (drawn from ``generator`` first, as the pipeline draws its
        posterior before the noise), kept for the steps of the schedule ``sigmas``."""
        if self.conditioned(model_config):
            self._sampling[id(sigmas)] = (sigmas, self.sample_condition(model_config, request, generator))

    def sample_condition(self, model_config: CosmosConfigBase, request: SampleRequest, generator: torch.Generator):
        """The :class:`~diffpipe_cosmos.video2world.SampleCondition` of ``[model] sample_video`` for ``request``:
        its first ``1 + temporal * (conditioning_frames - 1)`` frames, padded to the sample's length and encoded as
        the video-to-world pipeline's ``prepare_latents`` does."""
        import torch

        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.latents import normalize
        from diffpipe_cosmos import video2world
        from diffpipe_cosmos.plugin import latent_stats

        if model_config.sample_video is None:
            raise ValueError(
                "video-to-world samples continue a video: set [model] sample_video to a video or image file "
                '(conditioning = "video")'
            )
        temporal, spatial = self.vae_factors(model_config)  # type: ignore[attr-defined]
        want = 1 + temporal * (model_config.conditioning_frames - 1)
        key = (str(model_config.path), str(model_config.sample_video), want, request.width, request.height)
        key += (request.frames, model_config.encoder_dtype)
        if key not in self._posteriors:  # the VAE runs once per file and size; each sample draws from its posterior
            pixels = video2world.conditioning_pixels(
                model_config.sample_video, want, request.width, request.height, spatial
            )
            pixels, have = video2world.pad_frames(pixels.float(), request.frames, repeat_last=self.variant != "1.0")  # type: ignore[attr-defined]
            vae = load_components(self.folder, model_config, torch.device("cpu"), "vae").vae  # type: ignore[attr-defined]
            with torch.no_grad():
                posterior = vae.encode(pixels.to(vae.dtype)).latent_dist
                self._posteriors[key] = (posterior, latent_stats(vae)), have
        (posterior, stats), have = self._posteriors[key]
        latents = normalize(posterior.sample(generator).float(), *stats, self.sigma_data(model_config))  # type: ignore[attr-defined]
        cond = latents.new_zeros(1, 1, latents.shape[2], 1, 1)
        cond[:, :, : (have - 1) // temporal + 1] = 1.0
        return video2world.SampleCondition(latents, cond, generator)

    def conditioned_denoise_inputs(
        self, latents: torch.Tensor, schedule: torch.Tensor, index: int, model_config: CosmosConfigBase
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A video-to-world sample's transformer input ``(x | cond_mask, timestep)`` at ``schedule[index]``
        (:func:`diffpipe_cosmos.video2world.sample_inputs`); None for a text-to-world sample."""
        if id(schedule) not in self._sampling:
            return None
        from diffpipe_cosmos.video2world import sample_inputs

        condition = self._sampling[id(schedule)][1]
        return sample_inputs(self.variant, latents.float(), schedule[index], condition, model_config)  # type: ignore[attr-defined]

    def replace_conditioned(
        self, denoised: torch.Tensor, schedule: torch.Tensor, index: int, model_config: CosmosConfigBase
    ) -> torch.Tensor:
        """The denoised latents with the conditioning frames' replaced by the conditioning latents, as the
        pipelines do (unchanged for a text-to-world sample); the sample's conditioning is released after its last
        step."""
        if id(schedule) not in self._sampling:
            return denoised
        from diffpipe_cosmos.video2world import replaced

        condition = self._sampling[id(schedule)][1]
        cond = replaced(self.variant, condition, schedule[index], model_config)  # type: ignore[attr-defined]
        if index == len(schedule) - 2:
            del self._sampling[id(schedule)]
        return cond * condition.latents + (1 - cond) * denoised
