"""Write a tiny random-weight ERNIE-Image to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_ernie` saves a complete diffusers ``ErnieImagePipeline`` folder (``model_index.json``,
``transformer/``, ``vae/`` (``AutoencoderKLFlux2`` with random batch-norm statistics), ``text_encoder/``
(``Mistral3Model``: a Ministral 3 language model and a Pixtral vision tower), ``tokenizer/`` (a byte-level BPE adding
``<s>``, as Ministral's does), ``scheduler/``) and, beside it, the same transformer as one safetensors file under
``model.diffusion_model.`` in diffusers' names, as ComfyUI ships ERNIE-Image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffpipe_core.testing import tiny

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
#: ComfyUI's diffusion-model files hold the transformer under this prefix
COMFY_PREFIX = "model.diffusion_model."


@dataclass
class TinyErnieConfig:
    """Sizes of the tiny ERNIE-Image (head dim 16 = rotary axes 4 + 6 + 6; text width != hidden width, so the text
    projection exists as in the release)."""

    hidden_size: int = 32
    num_layers: int = 2
    num_attention_heads: int = 2
    ffn_hidden_size: int = 64
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    latent_channels: int = 4  # the VAE's; the transformer sees 4x as many (2x2 patches)
    vae_channels: tuple[int, ...] = (8, 8)  # the VAE halves each level but the first (the release: 8x, 4 levels)
    text_dim: int = 24  # Ministral 3's hidden size = text_in_dim
    text_layers: int = 3  # the pipeline reads hidden_states[-2]
    seed: int = 0


def tokenizer() -> Any:
    """A Ministral-like byte-level BPE tokenizer that prepends ``<s>`` (``add_special_tokens=True``)."""
    return tiny.bpe_tokenizer([" ".join(tiny.WORDS)], SPECIALS, "<s> $A", 512, pad_token="<pad>", bos_token="<s>",
                              eos_token="</s>", unk_token="<unk>")


def ministral3(tok: Any, cfg: TinyErnieConfig) -> Any:
    """A tiny ``Mistral3Model`` (ERNIE-Image's text encoder; its vision tower is never run)."""
    from transformers import Ministral3Config, Mistral3Config, Mistral3Model, PixtralVisionConfig

    text = Ministral3Config(
        vocab_size=len(tok), hidden_size=cfg.text_dim, intermediate_size=2 * cfg.text_dim,
        num_hidden_layers=cfg.text_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=12,
        max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, image_size=32, patch_size=8)
    return Mistral3Model(Mistral3Config(text_config=text, vision_config=vision))


def tiny_transformer(cfg: TinyErnieConfig) -> Any:
    """The random-weight diffusers ``ErnieImageTransformer2DModel`` of ``cfg`` (its zero-initialised modulation and
    output projection drawn at random, so every block counts)."""
    import torch
    from diffusers import ErnieImageTransformer2DModel

    torch.manual_seed(cfg.seed)
    model = ErnieImageTransformer2DModel(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, num_layers=cfg.num_layers,
        ffn_hidden_size=cfg.ffn_hidden_size, in_channels=4 * cfg.latent_channels,
        out_channels=4 * cfg.latent_channels, text_in_dim=cfg.text_dim, rope_axes_dim=cfg.rope_axes_dim,
    )
    with torch.no_grad():
        for linear in (model.adaLN_modulation[-1], model.final_linear):
            linear.weight.normal_(0, 0.1)
            linear.bias.normal_(0, 0.1)
    return model


def parts(cfg: TinyErnieConfig) -> dict[str, tiny.Part]:
    """The ``ErnieImagePipeline`` components of ``cfg``, in build order."""
    tok = tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny.flux2_vae(cfg.latent_channels, tuple(cfg.vae_channels)), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: ministral3(tok, cfg), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=3.0, use_dynamic_shifting=False)),
    }


def comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_ernie` puts ComfyUI's single file by default."""
    return tiny.beside(folder, ".comfyui.safetensors")


def write_tiny_ernie(folder: Path, cfg: TinyErnieConfig | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny ERNIE-Image pipeline folder at ``folder`` and its transformer as ComfyUI's single file at
    ``single_file`` (default :func:`comfy_path`). Returns ``folder``."""
    folder = Path(folder)
    pipe = tiny.write_pipeline("ErnieImagePipeline", parts(cfg or TinyErnieConfig()), folder)
    state = {f"{COMFY_PREFIX}{k}": v for k, v in pipe.transformer.state_dict().items()}
    tiny.save_single_file(state, Path(single_file or comfy_path(folder)))
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_ernie.testing FOLDER``: write a tiny ERNIE-Image (the folder and
    ``FOLDER.comfyui.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_ernie(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {comfy_path(folder)}")


def tiny_config(path: Path, **keys: Any) -> Any:
    """The validated ``[model]`` table of the tiny ERNIE-Image at ``path`` in float32 (24 text tokens), plus
    ``keys``."""
    from diffpipe_core.schema import validate
    from diffpipe_ernie.config import ErnieImageConfig

    table = {"type": "ernie-image", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 24}
    return validate(ErnieImageConfig, {**table, **keys}, "test")


if __name__ == "__main__":
    main()
