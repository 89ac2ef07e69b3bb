"""The sampling hooks models on a diffusers VAE share: loading the VAE alone and decoding (:class:`VAEDecoding`), the
flow-matching Euler step (:class:`FlowSampling`), and the start and the Euler step of a DDPM-trained epsilon or
v-prediction model with its pipeline's ``EulerDiscreteScheduler`` (:class:`DDPMSampling`). A plugin adds
``denoise_inputs`` (its first-layer inputs; a flow model also ``denoise_init``), and overrides
:meth:`FlowSampling.unpack_prediction` / :meth:`VAEDecoding.denormalize` where its latents are packed or normalised
differently from ``(z - shift_factor) * scaling_factor``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl

if TYPE_CHECKING:
    import torch

    from diffpipe_core.types import ModelConfigBase, SampleRequest


class VAEDecoding:
    """Mixin for a :class:`~diffpipe_core.parts.plugin.DiffusersModel` whose samples are decoded by its VAE."""

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """Undo the cache's latent normalisation before decoding (default: ``z / scaling_factor + shift_factor``)."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return latents.float() / vae.config.scaling_factor + shift

    def latent_shape(self, request: SampleRequest, model_config: ModelConfigBase) -> tuple[int, int, int, int]:
        """``(1, C, H/f, W/f)``: an image sample's latents as the image pipelines' ``prepare_latents`` make them, ``C``
        the diffusion model's ``in_channels`` (the VAE's ``latent_channels`` where its config has none), ``f`` the VAE's
        factor ``2 ** (levels - 1)`` from its ``block_out_channels``."""
        folder = self.model_folder(model_config)  # type: ignore[attr-defined]
        vae = self.folder.config(folder, "vae")  # type: ignore[attr-defined]
        factor = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
        config = self.model_folder_config(model_config)  # type: ignore[attr-defined]
        channels = int(config.get("in_channels", vae.get("latent_channels", 4)))
        return 1, channels, request.height // factor, request.width // factor

    @hookimpl
    def load_decoder(self, model_config: ModelConfigBase, device: torch.device) -> Any:
        """The VAE alone (``encoder_dtype``; from ``[model] vae`` when given), frozen, on ``device``."""
        from diffpipe_core.parts.encoders import torch_dtype

        dtype = torch_dtype(getattr(model_config, "encoder_dtype", "float32"))
        folder = self.model_folder(model_config)  # type: ignore[attr-defined]
        given = self.folder.component_files(folder, model_config).get("vae")  # type: ignore[attr-defined]
        return self.folder.load(folder, "vae", dtype, device, given)  # type: ignore[attr-defined]

    @hookimpl
    def decode_latents(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """:meth:`denormalize`, then the VAE's decoder; float RGB in [-1, 1]."""
        import torch

        with torch.no_grad():
            latents = self.denormalize(latents, decoder)
            param = next(decoder.parameters())
            return decoder.decode(latents.to(param.device, param.dtype)).sample.float().clamp(-1, 1)


class FrameVAEDecoding(VAEDecoding):
    """Mixin for an image model on a video VAE normalised per channel (Qwen-Image's ``AutoencoderKLQwenImage``, used
    by Qwen-Image and Krea 2): latents are cached as ``(z - latents_mean) / latents_std`` of the image as one frame
    (:func:`~diffpipe_core.parts.latents.normalize`), and decoded as the pipelines decode them."""

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """``latents / (1 / latents_std) + latents_mean``, one frame: ``(B, C, 1, h, w)``, as the pipelines decode."""
        from diffpipe_core.parts.latents import per_channel

        z = latents.float().unsqueeze(2)
        return z / (1.0 / per_channel(vae.config.latents_std, z)) + per_channel(vae.config.latents_mean, z)

    @hookimpl
    def decode_latents(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """:meth:`denormalize`, the VAE's decoder, its one frame; float RGB in [-1, 1]."""
        import torch

        with torch.no_grad():
            z = self.denormalize(latents, decoder)
            param = next(decoder.parameters())
            return decoder.decode(z.to(param.device, param.dtype)).sample[:, :, 0].float().clamp(-1, 1)


class FlowSampling(VAEDecoding):
    """Mixin for a :class:`~diffpipe_core.parts.plugin.DiffusersModel` whose sampler is the flow-matching Euler step,
    or the folder's own scheduler's step when ``denoise_init`` returned its
    :func:`~diffpipe_core.sampling.schedules.stepped_schedule` (a multistep solver such as Wan's UniPC)."""

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The last layer's prediction in the layout of ``latents`` (default: already in it)."""
        return prediction

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """From ``schedule[index]`` to ``schedule[index + 1]``: the folder scheduler's own step when the schedule
        carries it (:func:`~diffpipe_core.sampling.schedules.stepped_schedule`), else Euler on the flow ODE."""
        from diffpipe_core.sampling.schedules import flow_euler_step, scheduler_step

        prediction = self.unpack_prediction(prediction, latents)
        if getattr(schedule, "diffpipe_scheduler", None) is not None:
            return scheduler_step(latents, prediction, schedule, index)
        return flow_euler_step(latents, prediction, schedule, index)


#: ``scheduler/scheduler_config.json`` keys :class:`DDPMSampling` reads, with SD's and SDXL's values as defaults
EULER_DEFAULTS = {"timestep_spacing": "leading", "steps_offset": 1}


class DDPMSampling(VAEDecoding):
    """Mixin for a :class:`~diffpipe_core.parts.plugin.DiffusersModel` trained with
    :class:`~diffpipe_core.parts.config.DDPMConfig` (SD, SDXL): noise ``(1, C, H/f, W/f)`` from the VAE's config,
    scaled as ``EulerDiscreteScheduler`` scales it, and its Euler steps on the schedule of the ``[model]`` table
    (betas, ``zero_terminal_snr``; ``v_pred`` says what the model predicts), spaced as the folder's
    ``scheduler/scheduler_config.json`` says (``timestep_spacing``, ``steps_offset``). The schedule the hooks carry is
    the sigmas; :meth:`ddpm_timesteps` gives the model's timesteps for :func:`denoise_inputs`."""

    def scheduler_settings(self, model_config: Any) -> dict[str, Any]:
        """The spacing keys of the folder's scheduler config (SD's defaults where it has none); other sigma schedules
        (Karras, exponential, ``log_linear``) are refused, naming the file."""
        from diffpipe_core.model_files import read_json

        file = self.model_folder(model_config) / "scheduler" / "scheduler_config.json"  # type: ignore[attr-defined]
        found, _ = read_json(file)
        found = found or {}
        odd = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas") if found.get(k)]
        if odd or found.get("interpolation_type", "linear") != "linear":
            raise ValueError(f"{file}: {odd or 'interpolation_type'} is not supported for samples (linear sigmas only)")
        return {k: found.get(k, v) for k, v in EULER_DEFAULTS.items()}

    def ddpm_timesteps(self, model_config: Any, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(timesteps, sigmas)`` of ``steps`` Euler steps (:func:`diffpipe_core.sampling.schedules.ddpm_sigmas`)."""
        import torch

        from diffpipe_core.ddpm import alphas_cumprod
        from diffpipe_core.sampling.schedules import ddpm_sigmas

        cfg, spacing = model_config, self.scheduler_settings(model_config)
        betas = (cfg.num_train_timesteps, cfg.beta_start, cfg.beta_end)
        abar = alphas_cumprod(*betas, zero_terminal_snr=cfg.zero_terminal_snr, dtype=torch.float32)
        return ddpm_sigmas(abar, steps, spacing["timestep_spacing"], spacing["steps_offset"])

    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: Any, generator: torch.Generator):
        """Noise ``(1, C, H/f, W/f)`` times the scheduler's ``init_noise_sigma``, and the sigmas."""
        import torch

        from diffpipe_core.sampling.schedules import ddpm_init_sigma

        vae = self.folder.config(self.model_folder(model_config), "vae")  # type: ignore[attr-defined]
        factor = 2 ** (len(vae["block_out_channels"]) - 1)
        shape = (1, int(vae["latent_channels"]), request.height // factor, request.width // factor)
        _, sigmas = self.ddpm_timesteps(model_config, request.steps)
        spacing = self.scheduler_settings(model_config)["timestep_spacing"]
        return torch.randn(shape, generator=generator) * ddpm_init_sigma(sigmas, spacing), sigmas

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """The Euler step of an epsilon or (``v_pred``) v-prediction from ``schedule[index]`` to ``[index + 1]``."""
        from diffpipe_core.sampling.schedules import ddpm_euler_step

        return ddpm_euler_step(latents, prediction, schedule, index, model_config.v_pred)


class SampleImageConditioning:
    """Mixin (listed before the model's class) of an image-to-video model whose samples start from ``[model]
    sample_image``: :meth:`sample_condition` computes the conditioning once per image and sample size with the
    model's :meth:`encode_sample_image`, and ``denoise_init`` does so before the model's own ``denoise_init``."""

    def encode_sample_image(self, model_config: Any, request: SampleRequest) -> dict[str, Any]:
        """The conditioning tensors of ``model_config.sample_image`` at the request's size (the model's own)."""
        raise NotImplementedError

    def sample_condition(self, model_config: Any, request: SampleRequest) -> dict[str, Any]:
        """:meth:`encode_sample_image`, cached per model folder, image and sample size; a clear error without
        ``[model] sample_image``."""
        image = getattr(model_config, "sample_image", None)
        if image is None:
            raise ValueError(
                f"{self.spec.name} samples are generated from a first frame: set [model] sample_image to an image file"  # type: ignore[attr-defined]
            )
        cache = self.__dict__.setdefault("_sample_conditions", {})
        key = (str(model_config.path), str(image), request.width, request.height, request.frames)
        if key not in cache:
            cache[key] = self.encode_sample_image(model_config, request)
        return cache[key]

    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: Any, generator: torch.Generator):
        """The conditioning (:meth:`sample_condition`, computed here once), then the model's ``denoise_init``."""
        self.sample_condition(model_config, request)
        return super().denoise_init(request, model_config, generator)  # type: ignore[misc]
