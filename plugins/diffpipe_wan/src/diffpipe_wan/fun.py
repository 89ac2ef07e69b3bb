"""Wan Fun-Control (entry point ``wan-fun``: a ``WanTransformer3DModel`` whose patch embedding takes the control
video's latents on the channels, alibaba-pai's Wan2.1-Fun-Control and ComfyUI's ``wan2.1_fun_control_*`` files),
trained on clips paired with control videos.

Each clip of a ``[[directory]]`` pairs with the control video of the same relative path and stem in its
``control_path`` (the core decodes it at the clip's frames and size: ``ModelSpec.control_videos``), cached as its
normalised VAE latents (the posterior mode, as for targets). The transformer's input is the noisy latents with the
conditioning concatenated on the channels (:func:`diffpipe_wan.fun_encoding.condition`), the layout read from its
``in_channels``:

- ``3z`` (Wan 2.1 Fun-Control, 48 channels): ``[x_t | control latents | start-image latents]``;
- ``3z + 4`` (Wan 2.2 Fun-Control): ``[x_t | control latents | 4 mask channels | start-image latents]``.

The start image is not trained here: its latents are zeros in the normalised space and the mask is zero, what
ComfyUI's ``WanFunControlToVideo`` / ``Wan22FunControlToVideo`` give the model without a ``start_image`` (its
``concat_latent_image`` of normalised zeros; ``comfy/model_base.py`` ``WAN21.concat_cond`` normalising each 16-channel
block and, for 52 channels, putting ``1 - mask`` of an all-ones mask at channel 16). Samples are conditioned on
``[model] sample_control``. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_wan.config import WanFunConfig
from diffpipe_wan.control_video import ControlVideoSampling, read_clip
from diffpipe_wan.plugin import COMPONENTS, FILE_LAYOUTS, SIZES, Wan, boundary_ratio

if TYPE_CHECKING:
    import torch

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

V11_MODULES = ("ref_conv", "control_adapter")  # Fun V1.1's reference-image conv and camera adapter
CONTROL = "control_0_latents"  # the cached latents of an item's control video (core.types.control_key)


class WanFun(ControlVideoSampling, Wan):
    """Wan Fun-Control: clips with control videos (``control_path``); images and clips without one are refused."""
    plan_size = None  # no GPU-fit table yet
    tiny_writer = "diffpipe_wan.testing:write_tiny_wan_fun"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        Wan.spec,
        name="wan-fun",
        config_schema=WanFunConfig,
        control_images="required",
        control_videos=True,
        description="Wan Fun-Control (control video latents on the transformer's channels): video-to-video from "
        "control videos paired by file name",
    )
    folder = DiffusersFolder(
        "wan-fun",
        ("WanPipeline",),
        COMPONENTS,
        sizes=SIZES,
        single_file_example="wan2.1_fun_control_1.3B_bf16.safetensors",
        file_layouts=FILE_LAYOUTS,
    )

    def __init__(self) -> None:
        super().__init__()
        self._channels: dict[tuple[str, str], int] = {}

    def folder_problems(self, model_config: WanFunConfig) -> list[str]:
        """Wan's, and: the transformer's ``in_channels`` must be a Fun-Control layout; two experts are not trained."""
        found = super().folder_problems(model_config)
        if boundary_ratio(model_config.path) is not None:
            found.append(f"{model_config.path / 'model_index.json'}: a two-expert (Wan 2.2 A14B) folder; wan-fun "
                         "trains one transformer for now")
        config = self.model_folder_config(model_config)
        z, channels = int(config.get("out_channels", 16)), int(config.get("in_channels", 16))
        if channels not in (3 * z, 3 * z + 4):
            where = model_config.diffusion_model or model_config.path / "transformer" / "config.json"
            found.append(f"{where}: in_channels {channels} is not a Wan Fun-Control transformer's ({3 * z}: Wan 2.1 "
                         f"Fun-Control, {3 * z + 4}: Wan 2.2 Fun-Control, for {z} latent channels); a text-to-video "
                         "transformer trains as 'wan', an image-to-video / Fun-InP one as 'wan-i2v'")
        return found or self.file_problems(model_config)

    def file_problems(self, model_config: WanFunConfig) -> list[str]:
        """A ``diffusion_model`` with Fun V1.1's reference-image or camera modules, which ``WanTransformer3DModel``
        lacks, named (read from the file's header only)."""
        from diffpipe_core.model_files import safetensors_keys

        if model_config.diffusion_model is None:
            return []
        keys, _ = safetensors_keys(model_config.diffusion_model)
        extra = sorted({k.split(".")[0] for k in keys or () if k.split(".")[0] in V11_MODULES})
        if not extra:
            return []
        return [f"{model_config.diffusion_model}: a Wan Fun V1.1 transformer ({', '.join(extra)}: its reference image "
                "or camera control); wan-fun trains Fun-Control files without them (V1.0: Wan2.1-Fun-*-Control, "
                "ComfyUI's wan2.1_fun_control_*)"]

    def in_channels(self, model_config: WanFunConfig) -> int:
        """The transformer's input channels (its config, or the ``diffusion_model`` file's)."""
        key = (str(model_config.path), str(model_config.diffusion_model))
        if key not in self._channels:
            self._channels[key] = int(self.model_folder_config(model_config)["in_channels"])
        return self._channels[key]

    # ------------------------------------------------------------------------------------------ caching
    def encode_media(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Targets: Wan's ``latents`` (and ``mask``). Control videos (``batch.control_index`` 0): their ``latents``
        (normalised posterior mode, as the targets')."""
        if batch.pixels.dim() != 5:
            raise ValueError(f"wan-fun trains video clips with control videos; got pixels of shape "
                             f"{tuple(batch.pixels.shape)} (images)")
        if batch.control_index is None:
            return super().encode_media(encoders, batch)
        from diffpipe_wan import encoding

        pixels, _ = encoding.fit_to_patches(batch.pixels, None, encoders)
        return {"latents": encoding.latents(encoders.vae, pixels)}

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x, t, text_embeds), (velocity[, mask]))``, ``x`` the noisy latents and the control conditioning
        (module docstring); all randomness from ``generator``."""
        import torch

        from diffpipe_core.parts.flow import with_mask
        from diffpipe_wan.fun_encoding import condition

        if CONTROL not in batch:
            raise ValueError("wan-fun: a micro-batch without control videos (every item needs its control_path video)")
        f = self.noisy(batch, context, generator)
        cond = condition(batch[CONTROL].float(), self.in_channels(context.model_config))
        return (torch.cat([f.x_t, cond], dim=1), f.t, batch["text_embeds"].float()), with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(x, t, text_embeds)``, ``x`` the latents and the sample control video's conditioning."""
        import torch

        from diffpipe_core.sampling.schedules import schedule_time

        cond = self.sample_condition(model_config, request)
        b = latents.shape[0]
        t = schedule_time(schedule, index).float().expand(b)
        return torch.cat([latents.float(), cond.expand(b, -1, -1, -1, -1)], dim=1), t, text["text_embeds"].float()

    def encode_sample_control(self, model_config: WanFunConfig, request: SampleRequest,
                              size: tuple[int, int, int]) -> torch.Tensor:
        """``(1, in_channels - z, F', h, w)``: the conditioning of ``[model] sample_control``'s latents."""
        from diffpipe_wan import encoding
        from diffpipe_wan.fun_encoding import condition

        video = read_clip(model_config.sample_control, size, self.spec)[None]
        latents = encoding.latents(self.sample_vae(model_config), video)
        return condition(latents.float(), self.in_channels(model_config))


wan_fun = WanFun()
