"""Write a tiny random-weight AuraFlow to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_auraflow` saves a complete diffusers ``AuraFlowPipeline`` folder (``model_index.json``,
``transformer/`` (``AuraFlowTransformer2DModel``), ``vae/`` (``AutoencoderKL``, no shift, scaled to unit variance as
SDXL's is), ``text_encoder/`` (``UMT5EncoderModel``), ``tokenizer/``, ``scheduler/`` (shift 1.73)) and, beside it, the
same transformer as one safetensors file in the original layout (``double_layers.0.attn.w2q.weight``, ...), as ComfyUI
loads AuraFlow files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffpipe_core.testing import tiny


@dataclass
class TinyAuraFlowConfig(tiny.TinySizes):
    """Sizes of the tiny AuraFlow (width 32 = 2 heads x 16; UMT5 32 wide; up to 8x8 patches = 128x128 pixels)."""

    num_single_layers: int = 2
    pos_embed_max_size: int = 64


def tiny_transformer(cfg: TinyAuraFlowConfig) -> Any:
    """The random-weight diffusers ``AuraFlowTransformer2DModel`` of ``cfg``."""
    import torch
    from diffusers import AuraFlowTransformer2DModel

    torch.manual_seed(cfg.seed)
    return AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
        num_mmdit_layers=cfg.num_layers, num_single_dit_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim, num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.text_dim, caption_projection_dim=cfg.num_attention_heads * cfg.attention_head_dim,
        pos_embed_max_size=cfg.pos_embed_max_size,
    )


def parts(cfg: TinyAuraFlowConfig) -> dict[str, tiny.Part]:
    """The ``AuraFlowPipeline`` components of ``cfg``, in build order."""
    tokenizer = tiny.t5_tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        # SDXL's VAE takes 0.13025 to bring its latents to unit variance; this random one needs 3.0 for that
        "vae": tiny.Part(lambda: tiny.autoencoder_kl(cfg.latent_channels, scaling_factor=3.0), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: tiny.t5_encoder(tokenizer, dim=cfg.text_dim, umt5=True), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tokenizer),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=1.73)),
    }


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_auraflow` puts the original-layout single file by default."""
    return tiny.beside(folder, ".original.safetensors")


def write_tiny_auraflow(folder: Path, cfg: TinyAuraFlowConfig | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny AuraFlow pipeline folder at ``folder`` and its transformer in the original layout at
    ``single_file`` (default :func:`original_path`). Returns ``folder``."""
    from diffpipe_auraflow.original import diffusers_to_original

    folder = Path(folder)
    pipe = tiny.write_pipeline("AuraFlowPipeline", parts(cfg or TinyAuraFlowConfig()), folder)
    original = diffusers_to_original(pipe.transformer.state_dict())
    tiny.save_single_file(original, Path(single_file or original_path(folder)))
    return folder


def tiny_config(path: Path, **keys: Any) -> Any:
    """The validated ``[model]`` table of the tiny AuraFlow at ``path`` in float32 (16 UMT5 tokens), plus ``keys``."""
    from diffpipe_auraflow.config import AuraFlowConfig
    from diffpipe_core.schema import validate

    table = {"type": "auraflow", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    return validate(AuraFlowConfig, {**table, **keys}, "test")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_auraflow.testing FOLDER``: write a tiny AuraFlow (the folder and
    ``FOLDER.original.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_auraflow(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {original_path(folder)}")


if __name__ == "__main__":
    main()
