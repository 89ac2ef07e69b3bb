"""Loading a model's caching-time components (VAE, text encoders, tokenizers) from its diffusers folder.

``encode_batch`` gets no model config: :func:`load_components` returns an :class:`Encoders` object holding the
components by folder name and the run's ``[model]`` table as ``encoders.config``, which is how settings such as a
token length reach ``encode_batch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core.parts.folder import find_class
from diffpipe_core.types import ModelConfigBase

if TYPE_CHECKING:
    import torch

    from diffpipe_core.parts.folder import DiffusersFolder

DTYPES = ("float32", "bfloat16", "float16")
#: the modes of ``[model] encoder_quantize``: bitsandbytes NF4 (4 bits) and LLM.int8()
QUANTIZE = ("nf4", "int8")


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


def quantization_config(mode: str, dtype: torch.dtype) -> Any:
    """The transformers ``BitsAndBytesConfig`` of ``[model] encoder_quantize = mode`` (:data:`QUANTIZE`): nf4
    computing in ``dtype``, or int8 (LLM.int8()). ValueError for another mode or without bitsandbytes."""
    import importlib.util

    if mode not in QUANTIZE:
        raise ValueError(f"[model] encoder_quantize: unknown mode {mode!r}; valid: {', '.join(QUANTIZE)}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"[model] encoder_quantize = {mode!r} needs the bitsandbytes package (pip install "
                         "bitsandbytes), or remove encoder_quantize")
    from transformers import BitsAndBytesConfig

    if mode == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def encoder_quantization(
    folder: DiffusersFolder, model_config: ModelConfigBase, names: tuple[str, ...], files: dict[str, Any],
    dtype: torch.dtype, mode: str | None = None,
) -> dict[str, Any]:
    """``{component: BitsAndBytesConfig}`` for the text encoders among ``names`` that ``mode`` (default ``[model]
    encoder_quantize``) quantizes: each ``text_encoder*`` component (and the folder's declared
    :attr:`~diffpipe_core.parts.folder.DiffusersFolder.text_encoders`), all transformers models; image encoders and
    the VAE stay as they are. ValueError, before anything loads, for a text encoder given as a component file
    (``files``: bitsandbytes quantizes the folder's weights as they are read) or one that is not a transformers
    model."""
    mode = mode or getattr(model_config, "encoder_quantize", None)
    if mode is None:
        return {}
    from transformers import PreTrainedModel

    chosen = [n for n in names if n in folder.text_encoder_names() and not n.startswith("image_encoder")]
    for name in chosen:
        if name in files:
            raise ValueError(
                f"[model] encoder_quantize = {mode!r} quantizes the folder's {name} as it is read, but "
                f"[model] text_encoders gives {name} as a file; leave that file out (the folder's {name}/ weights "
                "are then read) or remove encoder_quantize"
            )
        if not issubclass(find_class(folder.component_class(name, model_config.path)), PreTrainedModel):  # type: ignore[attr-defined]
            raise ValueError(f"[model] encoder_quantize: {name} is not a transformers model; remove encoder_quantize")
    config = quantization_config(mode, dtype) if chosen else None
    return {name: config for name in chosen}


def load_components(
    folder: DiffusersFolder, model_config: ModelConfigBase, device: Any, *names: str, dtype: str | None = None
) -> Encoders:
    """Each named component of ``model_config.path`` (``folder``'s classes), or of the component file that replaces
    its weights (``[model] vae``, ``text_encoders``), models in ``dtype`` (default the config's ``encoder_dtype``),
    frozen, on ``device``; text encoders quantized as they are read with ``[model] encoder_quantize``
    (:func:`encoder_quantization`)."""
    dtype = torch_dtype(dtype or getattr(model_config, "encoder_dtype", "float32"))
    path = model_config.path  # type: ignore[attr-defined]
    files = folder.component_files(path, model_config)  # [model] vae / text_encoders given as files
    quantized = encoder_quantization(folder, model_config, names, files, dtype)
    loaded = {name: folder.load(path, name, dtype, device, files.get(name), quantized.get(name)) for name in names}
    return Encoders(model_config, device, **loaded)
