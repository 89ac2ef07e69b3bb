"""Write a tiny random-weight SD3 to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_sd3` saves a complete diffusers ``StableDiffusion3Pipeline`` folder (``model_index.json``,
``transformer/`` (an SD3.5-Medium-like ``SD3Transformer2DModel``: q/k RMS norms, a second attention in block 0),
``vae/`` (``AutoencoderKL`` with SD3's scaling and shift), ``text_encoder/`` and ``text_encoder_2/``
(``CLIPTextModelWithProjection``), ``text_encoder_3/`` (``T5EncoderModel``), the three tokenizers, ``scheduler/``)
and, beside it, the same transformer as one safetensors file in Stability's layout under ``model.diffusion_model.``
(``joint_blocks.0.x_block.attn.qkv.weight``, ...), as ``sd3.5_medium.safetensors`` holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffpipe_core.testing import tiny

PREFIX = "model.diffusion_model."  # where Stability's SD3 files hold the transformer


@dataclass
class TinySD3Config(tiny.TinySizes):
    """Sizes of the tiny SD3: width 32 = 2 heads x 16; CLIP-L 16 and CLIP-G 32 wide (their pooled vectors side by
    side: 48; told apart by their widths, as the real 768 and 1280), T5 64 wide (the CLIP states are padded to it)."""

    text_dim: int = 64
    dual_attention_layers: tuple[int, ...] = (0,)
    qk_norm: str | None = "rms_norm"
    clip_l_dim: int = 16
    clip_g_dim: int = 32
    pos_embed_max_size: int = 32


def tiny_transformer(cfg: TinySD3Config) -> Any:
    """The random-weight diffusers ``SD3Transformer2DModel`` of ``cfg``."""
    import torch
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(cfg.seed)
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    return SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
        num_layers=cfg.num_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, joint_attention_dim=cfg.text_dim, caption_projection_dim=inner,
        pooled_projection_dim=cfg.clip_l_dim + cfg.clip_g_dim, pos_embed_max_size=cfg.pos_embed_max_size,
        dual_attention_layers=cfg.dual_attention_layers, qk_norm=cfg.qk_norm,
    )


def parts(cfg: TinySD3Config) -> dict[str, tiny.Part]:
    """The ``StableDiffusion3Pipeline`` components of ``cfg``, in build order."""
    clip, t5 = tiny.clip_tokenizer(), tiny.t5_tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(
            lambda: tiny.autoencoder_kl(cfg.latent_channels, scaling_factor=1.5305, shift_factor=0.0609),
            seed=cfg.seed + 1,
        ),
        "text_encoder": tiny.Part(lambda: tiny.clip_text(clip, cfg.clip_l_dim, projection=True), seed=cfg.seed + 2),
        "text_encoder_2": tiny.Part(lambda: tiny.clip_text(clip, cfg.clip_g_dim, projection=True), seed=cfg.seed + 3),
        "text_encoder_3": tiny.Part(lambda: tiny.t5_encoder(t5, cfg.text_dim), seed=cfg.seed + 4),
        "tokenizer": tiny.Part(lambda: clip),
        "tokenizer_2": tiny.Part(lambda: clip),
        "tokenizer_3": tiny.Part(lambda: t5),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=3.0)),
    }


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_sd3` puts the Stability-layout single file by default."""
    return tiny.beside(folder, ".original.safetensors")


def write_tiny_sd3(folder: Path, cfg: TinySD3Config | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny SD3 pipeline folder at ``folder`` and its transformer in Stability's layout (under
    ``model.diffusion_model.``) at ``single_file`` (default :func:`original_path`). Returns ``folder``."""
    from diffpipe_sd3.original import diffusers_to_original

    folder = Path(folder)
    pipe = tiny.write_pipeline("StableDiffusion3Pipeline", parts(cfg or TinySD3Config()), folder)
    original = diffusers_to_original(pipe.transformer.state_dict(), pipe.transformer.config)
    tiny.save_single_file({PREFIX + k: v for k, v in original.items()}, Path(single_file or original_path(folder)))
    return folder


def tiny_config(path: Path, **keys: Any) -> Any:
    """The validated ``[model]`` table of the tiny SD3 at ``path`` in float32 (16 T5 tokens), plus ``keys``."""
    from diffpipe_core.schema import validate
    from diffpipe_sd3.config import SD3Config

    table = {"type": "sd3", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    return validate(SD3Config, {**table, **keys}, "test")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_sd3.testing FOLDER``: write a tiny SD3 (the folder and ``FOLDER.original.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_sd3(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {original_path(folder)}")


if __name__ == "__main__":
    main()
