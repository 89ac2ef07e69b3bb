"""Write a tiny random-weight Z-Image to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_zimage` saves a complete diffusers ``ZImagePipeline`` folder (``model_index.json``,
``transformer/``, ``vae/`` (``AutoencoderKL`` with Flux's scaling and shift), ``text_encoder/`` (``Qwen3Model``),
``tokenizer/`` (a byte-level BPE with a Qwen3 chat template), ``scheduler/``) and, beside it, the same transformer as
one safetensors file in the original layout (``layers.0.attention.qkv.weight``, ...), as ComfyUI ships Z-Image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffpipe_core.testing import tiny
from diffpipe_core.testing.tiny import QWEN3_CHAT_TEMPLATE, QWEN3_SPECIALS, qwen3_tokenizer  # noqa: F401


@dataclass
class TinyZImageConfig:
    """Sizes of the tiny Z-Image (head dim 16 = rotary axes 4 + 6 + 6)."""

    dim: int = 32
    n_layers: int = 2
    n_refiner_layers: int = 2
    n_heads: int = 2
    axes_dims: tuple[int, int, int] = (4, 6, 6)
    axes_lens: tuple[int, int, int] = (256, 32, 32)
    latent_channels: int = 4
    text_dim: int = 32  # Qwen3 hidden size = cap_feat_dim
    qwen_layers: int = 3  # the pipeline takes hidden_states[-2]
    seed: int = 0


def qwen3(tokenizer: Any, dim: int = 32, layers: int = 3) -> Any:
    """A tiny ``Qwen3Model`` (the text encoder; Z-Image reads its penultimate hidden state)."""
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(tiny.decoder_config(Qwen3Config, tokenizer, dim, layers, head_dim=dim // 4))


def tiny_transformer(cfg: TinyZImageConfig) -> Any:
    """The random-weight diffusers ``ZImageTransformer2DModel`` of ``cfg``."""
    import torch
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(cfg.seed)
    model = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=cfg.latent_channels,
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_refiner_layers=cfg.n_refiner_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        cap_feat_dim=cfg.text_dim,
        axes_dims=list(cfg.axes_dims),
        axes_lens=list(cfg.axes_lens),
    )
    with torch.no_grad():  # the pad tokens start at zero; make them count
        model.x_pad_token.normal_()
        model.cap_pad_token.normal_()
    return model


def parts(cfg: TinyZImageConfig) -> dict[str, tiny.Part]:
    """The ``ZImagePipeline`` components of ``cfg``, in build order."""
    tok = qwen3_tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(
            lambda: tiny.autoencoder_kl(cfg.latent_channels, scaling_factor=0.3611, shift_factor=0.1159),
            seed=cfg.seed + 1,
        ),
        "text_encoder": tiny.Part(lambda: qwen3(tok, cfg.text_dim, cfg.qwen_layers)),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=3.0, use_dynamic_shifting=False)),
    }


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_zimage` puts the original-layout single file by default."""
    return tiny.beside(folder, ".original.safetensors")


def write_tiny_zimage(folder: Path, cfg: TinyZImageConfig | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny Z-Image pipeline folder at ``folder`` and its transformer in the original layout at
    ``single_file`` (default :func:`original_path`). Returns ``folder``."""
    from diffpipe_zimage.original import diffusers_to_original

    folder = Path(folder)
    pipe = tiny.write_pipeline("ZImagePipeline", parts(cfg or TinyZImageConfig()), folder)
    original = diffusers_to_original(pipe.transformer.state_dict())
    tiny.save_single_file(original, Path(single_file or original_path(folder)))
    return folder


def apply_comfyui_lora(original: dict[str, Any], comfy: dict[str, Any]) -> dict[str, Any]:
    """Original-layout weights with a ComfyUI-format LoRA merged the way ComfyUI merges it
    (:func:`diffpipe_core.testing.runs.apply_comfyui`; ComfyUI's native names are the original ones)."""
    from diffpipe_core.testing.runs import apply_comfyui

    return apply_comfyui(original, comfy)


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_zimage.testing FOLDER``: write a tiny Z-Image (the folder and
    ``FOLDER.original.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_zimage(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {original_path(folder)}")


def tiny_config(path: Path, **keys: Any) -> Any:
    """The validated ``[model]`` table of the tiny Z-Image at ``path`` in float32 (40 text tokens), plus ``keys``."""
    from diffpipe_core.schema import validate
    from diffpipe_zimage.config import ZImageConfig

    table = {"type": "z-image", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 40}
    return validate(ZImageConfig, {**table, **keys}, "test")


if __name__ == "__main__":
    main()
