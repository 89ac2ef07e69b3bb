"""Write a tiny random-weight Ideogram 4 to disk in its real layouts, for tests and benchmarks.

:func:`write_tiny_ideogram4` saves a diffusers ``Ideogram4Pipeline`` folder: ``transformer/`` and
``unconditional_transformer/`` (two ``Ideogram4Transformer2DModel`` of different weights), ``vae/`` (FLUX.2's
``AutoencoderKLFlux2``, 8x, random batch-norm statistics: the core's tiny builder), ``text_encoder/`` (a bare
``Qwen3VLModel`` of 36 layers, so the pipeline's 13 fixed taps 0..35 exist), ``tokenizer/`` (trained in-process, a
Qwen2-VL chat template), ``scheduler/``; and beside it each transformer as one file in Ideogram's original layout
under ``model.diffusion_model.`` (:func:`comfy_path`, :func:`unconditional_comfy_path`), as ComfyUI's files hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.testing import tiny

#: the Qwen3-VL decoder layers whose hidden states the pipeline concatenates (``QWEN3_VL_ACTIVATION_LAYERS``)
TAPS = 13


@dataclass
class TinyIdeogram4Config(tiny.TinySizes):
    """Sizes of the tiny Ideogram 4: 2 blocks of 2 heads of 16 (MRoPE sections 4 + 2 + 2 of the head's 8
    frequencies), 4 VAE channels (16 after 2x2 patching), a 36-layer Qwen3-VL of width ``text_dim``."""

    mrope_section: tuple[int, int, int] = (4, 2, 2)
    text_layers: int = 36
    vae_channels: tuple[int, ...] = (8, 8, 8, 8)


def tokenizer() -> Any:
    """A Qwen2-VL-like tokenizer (the core's) with a chat template, trained on a few captions."""
    return tiny.qwen2_vl_tokenizer(["<|im_start|>user\na photo of a red cat<|im_end|>\n<|im_start|>assistant\n"])


def tiny_transformer(cfg: TinyIdeogram4Config, seed: int | None = None) -> Any:
    """The random-weight diffusers ``Ideogram4Transformer2DModel`` of ``cfg`` (its zero-initialised tensors given the
    weights a trained model would have)."""
    from diffusers import Ideogram4Transformer2DModel

    torch.manual_seed(cfg.seed if seed is None else seed)
    model = Ideogram4Transformer2DModel(
        in_channels=cfg.latent_channels * 4, num_layers=cfg.num_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=48, adaln_dim=32,
        llm_features_dim=TAPS * cfg.text_dim, rope_theta=10_000, mrope_section=tuple(cfg.mrope_section),
    )
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.2)
    return model


def parts(cfg: TinyIdeogram4Config) -> dict[str, tiny.Part]:
    """The ``Ideogram4Pipeline`` components of ``cfg``, in build order."""
    tok = tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "unconditional_transformer": tiny.Part(lambda: tiny_transformer(cfg, cfg.seed + 3)),
        "vae": tiny.Part(lambda: tiny.flux2_vae(cfg.latent_channels, tuple(cfg.vae_channels)), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: tiny.qwen3_vl(tok, cfg.text_dim, cfg.text_layers, head=False),
                                  seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler()),
    }


def comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_ideogram4` puts the original-layout single file of ``folder``'s transformer."""
    return tiny.beside(folder, "-comfy.safetensors")


def unconditional_comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_ideogram4` puts the unconditional transformer's original-layout file (ComfyUI's
    ``ideogram4_unconditional_fp8_scaled.safetensors`` layout)."""
    return tiny.beside(folder, "-unconditional-comfy.safetensors")


def write_tiny_ideogram4(folder: Path, cfg: TinyIdeogram4Config | None = None) -> Path:
    """A tiny ``Ideogram4Pipeline`` folder and, beside it, its two transformers as original-layout files
    (:func:`comfy_path`, :func:`unconditional_comfy_path`)."""
    from diffpipe_ideogram.original import layout_for_config

    cfg = cfg or TinyIdeogram4Config()
    folder = Path(folder)
    pipe = tiny.write_pipeline("Ideogram4Pipeline", parts(cfg), folder)
    for model, path in ((pipe.transformer, comfy_path(folder)),
                        (pipe.unconditional_transformer, unconditional_comfy_path(folder))):
        state = layout_for_config(dict(model.config)).to_original(model.state_dict())
        tiny.save_single_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, path)
    return folder


def load_pipeline(folder: Path) -> Any:
    """The ``Ideogram4Pipeline`` of a tiny folder (float32)."""
    from diffusers import Ideogram4Pipeline

    pipe = Ideogram4Pipeline.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_ideogram.testing FOLDER``: write a tiny Ideogram 4 (the folder,
    ``FOLDER-comfy.safetensors`` and ``FOLDER-unconditional-comfy.safetensors``, the transformers in Ideogram's
    original layout)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_ideogram4(parser.parse_args(argv).folder)
    print(f"wrote {folder}, {comfy_path(folder)} and {unconditional_comfy_path(folder)}")


if __name__ == "__main__":
    main()
