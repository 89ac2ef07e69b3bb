"""Write a tiny random-weight Lumina Image 2.0 to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_lumina2` saves a complete diffusers ``Lumina2Pipeline`` folder (``model_index.json``,
``transformer/`` (``Lumina2Transformer2DModel`` with grouped key/value heads), ``vae/`` (``AutoencoderKL`` with Flux's
scaling and shift), ``text_encoder/`` (``Gemma2Model``), ``tokenizer/`` (a byte-level BPE with Gemma's ``<bos>``,
right padding), ``scheduler/`` (a fixed shift)) and, beside it, the same transformer as one safetensors file in the
original layout (``layers.0.attention.qkv.weight``, ...), as ComfyUI loads Lumina 2 files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffpipe_core.testing import tiny


@dataclass
class TinyLumina2Config:
    """Sizes of the tiny Lumina 2 (width 32 = 2 heads x 16, 1 key/value head; rotary axes 4 + 6 + 6)."""

    hidden_size: int = 32
    num_layers: int = 2
    num_refiner_layers: int = 2
    num_attention_heads: int = 2
    num_kv_heads: int = 1
    axes_dim_rope: tuple[int, int, int] = (4, 6, 6)
    axes_lens: tuple[int, int, int] = (300, 64, 64)
    latent_channels: int = 4
    text_dim: int = 32  # Gemma 2 hidden size = cap_feat_dim
    gemma_layers: int = 3  # the pipeline takes hidden_states[-2]
    seed: int = 0


def gemma_tokenizer(max_length: int = 512) -> Any:
    """A Gemma-like byte-level BPE tokenizer (``<bos>`` first, ``<pad>`` padding) trained on the pipeline's system
    prompt and :data:`~diffpipe_core.testing.tiny.WORDS`, so the system prompt costs a token per word."""
    from diffpipe_lumina.config import SYSTEM_PROMPT

    texts = [f"{SYSTEM_PROMPT} <Prompt Start> a photo", " ".join(tiny.WORDS)]
    names = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
    return tiny.bpe_tokenizer(texts, ["<pad>", "<eos>", "<bos>", "<unk>"], "<bos> $A", max_length, **names)


def gemma2(tokenizer: Any, dim: int = 32, layers: int = 3) -> Any:
    """A tiny ``Gemma2Model`` (the text encoder; Lumina 2 reads its penultimate hidden state)."""
    from transformers import Gemma2Config, Gemma2Model

    keys = {"head_dim": dim // 4, "bos_token_id": tokenizer.bos_token_id, "query_pre_attn_scalar": dim // 4}
    return Gemma2Model(tiny.decoder_config(Gemma2Config, tokenizer, dim, layers, **keys))


def tiny_transformer(cfg: TinyLumina2Config) -> Any:
    """The random-weight diffusers ``Lumina2Transformer2DModel`` of ``cfg``."""
    import torch
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(cfg.seed)
    return Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=cfg.latent_channels, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers, num_refiner_layers=cfg.num_refiner_layers,
        num_attention_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_kv_heads, multiple_of=16,
        axes_dim_rope=tuple(cfg.axes_dim_rope), axes_lens=tuple(cfg.axes_lens), cap_feat_dim=cfg.text_dim,
    )


def parts(cfg: TinyLumina2Config) -> dict[str, tiny.Part]:
    """The ``Lumina2Pipeline`` components of ``cfg``, in build order."""
    tok = gemma_tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(
            lambda: tiny.autoencoder_kl(cfg.latent_channels, scaling_factor=0.3611, shift_factor=0.1159),
            seed=cfg.seed + 1,
        ),
        "text_encoder": tiny.Part(lambda: gemma2(tok, cfg.text_dim, cfg.gemma_layers), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=6.0)),
    }


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_lumina2` puts the original-layout single file by default."""
    return tiny.beside(folder, ".original.safetensors")


def write_tiny_lumina2(folder: Path, cfg: TinyLumina2Config | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny Lumina 2 pipeline folder at ``folder`` and its transformer in the original layout at
    ``single_file`` (default :func:`original_path`). Returns ``folder``."""
    from diffpipe_lumina.original import diffusers_to_original

    folder = Path(folder)
    pipe = tiny.write_pipeline("Lumina2Pipeline", parts(cfg or TinyLumina2Config()), folder)
    original = diffusers_to_original(pipe.transformer.state_dict(), pipe.transformer.config)
    tiny.save_single_file(original, Path(single_file or original_path(folder)))
    return folder


def tiny_config(path: Path, **keys: Any) -> Any:
    """The validated ``[model]`` table of the tiny Lumina 2 at ``path`` in float32 (48 Gemma tokens), plus ``keys``."""
    from diffpipe_core.schema import validate
    from diffpipe_lumina.config import Lumina2Config

    table = {"type": "lumina2", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 48}
    return validate(Lumina2Config, {**table, **keys}, "test")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_lumina.testing FOLDER``: write a tiny Lumina 2 (the folder and
    ``FOLDER.original.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_lumina2(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {original_path(folder)}")


if __name__ == "__main__":
    main()
