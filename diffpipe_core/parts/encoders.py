"""Loading a model's caching-time components (VAE, text encoders, tokenizers) from its diffusers folder.

``encode_batch`` gets no model config: :func:`load_components` returns an :class:`Encoders` object holding the
components by folder name and the run's ``[model]`` table as ``encoders.config``, which is how settings such as a
token length reach ``encode_batch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core.types import ModelConfigBase

if TYPE_CHECKING:
    import torch

    from diffpipe_core.parts.folder import DiffusersFolder

DTYPES = ("float32", "bfloat16", "float16")


class Encoders:
    """The loaded components as attributes (``encoders.vae``, ``encoders.text_encoder_2``, ``encoders.tokenizer``),
    the ``[model]`` table as ``encoders.config`` and the device as ``encoders.device``."""

    def __init__(self, config: ModelConfigBase, device: Any, **components: Any) -> None:
        self.config, self.device = config, device
        self.__dict__.update(components)


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (the ``[model]`` dtype names)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return getattr(torch, name)


def load_components(
    folder: DiffusersFolder, model_config: ModelConfigBase, device: Any, *names: str, dtype: str | None = None
) -> Encoders:
    """Each named component of ``model_config.path`` (``folder``'s classes), or of the component file that replaces
    its weights (``[model] vae``, ``text_encoders``), models in ``dtype`` (default the config's ``encoder_dtype``),
    frozen, on ``device``."""
    dtype = torch_dtype(dtype or getattr(model_config, "encoder_dtype", "float32"))
    path = model_config.path  # type: ignore[attr-defined]
    files = folder.component_files(path, model_config)  # [model] vae / text_encoders given as files
    loaded = {name: folder.load(path, name, dtype, device, files.get(name)) for name in names}
    return Encoders(model_config, device, **loaded)
