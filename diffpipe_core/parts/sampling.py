"""The sampling hooks every flow-matching model on a diffusers VAE shares: the Euler step, loading the VAE alone,
and decoding. A plugin adds ``denoise_init`` and ``denoise_inputs`` (its noise layout and first-layer inputs), and
overrides :meth:`FlowSampling.unpack_prediction` / :meth:`FlowSampling.denormalize` where its latents are packed or
normalised differently from ``(z - shift_factor) * scaling_factor``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl

if TYPE_CHECKING:
    import torch

    from diffpipe_core.types import ModelConfigBase


class FlowSampling:
    """Mixin for a :class:`~diffpipe_core.parts.plugin.DiffusersModel` whose sampler is the flow-matching Euler step."""

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The last layer's prediction in the layout of ``latents`` (default: already in it)."""
        return prediction

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """Undo the cache's latent normalisation before decoding (default: ``z / scaling_factor + shift_factor``)."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return latents.float() / vae.config.scaling_factor + shift

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """Euler on the flow ODE from ``schedule[index]`` to ``schedule[index + 1]``."""
        from diffpipe_core.sampling.schedules import flow_euler_step

        return flow_euler_step(latents, self.unpack_prediction(prediction, latents), schedule, index)

    @hookimpl
    def load_decoder(self, model_config: ModelConfigBase, device: torch.device) -> Any:
        """The VAE alone (``encoder_dtype``), frozen, on ``device``."""
        from diffpipe_core.parts.encoders import torch_dtype

        dtype = torch_dtype(getattr(model_config, "encoder_dtype", "float32"))
        return self.folder.load(model_config.path, "vae", dtype, device)  # type: ignore[attr-defined]

    @hookimpl
    def decode_latents(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """:meth:`denormalize`, then the VAE's decoder; float RGB in [-1, 1]."""
        import torch

        with torch.no_grad():
            latents = self.denormalize(latents, decoder)
            param = next(decoder.parameters())
            return decoder.decode(latents.to(param.device, param.dtype)).sample.float().clamp(-1, 1)
