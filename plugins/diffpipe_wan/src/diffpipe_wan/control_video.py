"""What the Wan models trained on control videos (``wan-vace``, ``wan-fun``) share for sampling: the conditioning of
``[model] sample_control`` at the sample's size and frames, computed once per file and size. This module imports no
torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl

if TYPE_CHECKING:
    import torch

    from diffpipe_core.types import SampleRequest
    from diffpipe_wan.config import WanControlConfig


class ControlVideoSampling:
    """Mixin of a Wan model (``self.spec``, ``self.folder``, ``self.model_folder_config``) whose samples are
    conditioned on ``[model] sample_control``; the model class encodes it in :meth:`encode_sample_control`."""

    def __init__(self) -> None:
        self._conditions: dict[tuple, torch.Tensor] = {}  # sample conditioning, per control video and size

    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: WanControlConfig, generator: torch.Generator):
        """Wan's noise and schedule; the conditioning of ``[model] sample_control`` is computed here once per size."""
        self.sample_condition(model_config, request)
        return super().denoise_init(request, model_config, generator)

    def encode_sample_control(self, model_config: WanControlConfig, request: SampleRequest,
                              size: tuple[int, int, int]) -> torch.Tensor:
        """The conditioning ``(1, C, F', h, w)`` of ``[model] sample_control`` at ``size`` (pixels and frames)."""
        raise NotImplementedError

    def sample_condition(self, model_config: WanControlConfig, request: SampleRequest) -> torch.Tensor:
        """The conditioning of ``[model] sample_control`` (and a VACE ``sample_mask``) decoded at the sample's size
        and frames (:func:`read_clip`); cached per file and size."""
        if model_config.sample_control is None:
            raise ValueError(f"{self.spec.name} samples are generated from a control video: set [model] "
                             "sample_control to a video file")
        key = (str(model_config.path), str(model_config.sample_control), str(getattr(model_config, "sample_mask", "")),
               str(getattr(model_config, "sample_reference", "")),
               request.width, request.height, request.frames)
        if key not in self._conditions:
            self._conditions[key] = self.encode_sample_control(model_config, request, self.pixel_size(model_config,
                                                                                                       request))
        return self._conditions[key]

    def pixel_size(self, model_config: WanControlConfig, request: SampleRequest) -> tuple[int, int, int]:
        """``(width, height, frames)`` of the sample's video: its latent grid times the VAE's factors."""
        from diffpipe_wan import encoding

        vae_config = self.folder.config(model_config.path, "vae")
        _, _, frames, h, w = encoding.latent_shape(vae_config, self.model_folder_config(model_config), request)
        spatial = int(vae_config.get("scale_factor_spatial", 8))
        temporal = int(vae_config.get("scale_factor_temporal", 4))
        return w * spatial, h * spatial, temporal * (frames - 1) + 1

    def sample_vae(self, model_config: WanControlConfig) -> Any:
        """The folder's VAE (or ``[model] vae``'s file) on the host, to encode the sample control video."""
        import torch

        from diffpipe_core.parts.encoders import load_components

        return load_components(self.folder, model_config, torch.device("cpu"), "vae").vae


def read_clip(path: Path, size: tuple[int, int, int], spec: Any) -> torch.Tensor:
    """``(3, F, H, W)`` in [-1, 1]: the first ``F`` frames of video ``path`` at the model's frame rate, resized to
    cover ``W x H`` and center-cropped (the core's decoder, as training decodes clips)."""
    from diffpipe_core.data.decode import load_media
    from diffpipe_core.data.items import Bucket, MediaItem

    width, height, frames = size
    item = MediaItem(id=str(path), path=Path(path), caption="", bucket=Bucket(width, height, frames),
                     content_key="", clip_start=0.0)
    return load_media(item, spec).pixels
