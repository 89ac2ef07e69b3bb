"""Write a tiny random-weight HunyuanImage-2.1 to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_hunyuan_image` saves a complete diffusers ``HunyuanImagePipeline`` folder: ``transformer/``
(``HunyuanImageTransformer2DModel``; with ``distilled``, its guidance embedding and MeanFlow time), ``vae/``
(``AutoencoderKLHunyuanImage``, 4x here), ``text_encoder/`` (``Qwen2_5_VLForConditionalGeneration``), ``tokenizer/``
(a Qwen2.5-VL-like BPE trained on the pipeline's template, which it cuts into the same 34 tokens as the real one),
``text_encoder_2/`` (a T5 encoder), ``tokenizer_2/`` (``ByT5Tokenizer``), ``scheduler/``, and for the base model
``guider/`` and ``ocr_guider/`` (``AdaptiveProjectedMixGuidance``, the projected guidance from the third and the
second step on, so a 3-step sample meets both phases); and beside it the transformer as one file in Tencent's key
layout (:func:`original_path`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from diffpipe_core.testing import tiny

#: the pipeline's template up to the caption (its first 34 tokens are dropped)
PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")


@dataclass
class TinyHunyuanImageConfig(tiny.TinySizes):
    """Sizes of the tiny HunyuanImage-2.1: 1 double + 2 single blocks of 2 heads of 16, 8 latent channels from a
    3-level 32-channel VAE (4x), Qwen2.5-VL of ``text_dim`` (3 layers: the pipeline takes the third state from the
    end), ByT5 of ``glyph_dim``."""

    num_layers: int = 1
    num_single_layers: int = 2
    latent_channels: int = 8
    glyph_dim: int = 32
    qwen_layers: int = 3
    rope_axes_dim: tuple[int, int] = (8, 8)
    vae_channels: tuple[int, ...] = (32, 32, 32)


def tokenizer() -> Any:
    """A Qwen2.5-VL-like tokenizer (the core's) trained on the pipeline's template and a few captions."""
    return tiny.qwen2_vl_tokenizer([PREFIX + 'a photo of a red cat with the text "HELLO"<|im_end|>'])


def tiny_transformer(cfg: TinyHunyuanImageConfig, distilled: bool = False) -> Any:
    """The random-weight ``HunyuanImageTransformer2DModel`` of ``cfg`` (``distilled``: guidance embedding and
    MeanFlow), its zero-initialised gates given the weights a trained model has."""
    from diffusers import HunyuanImageTransformer2DModel

    torch.manual_seed(cfg.seed)
    model = HunyuanImageTransformer2DModel(
        in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads, attention_head_dim=cfg.attention_head_dim,
        num_layers=cfg.num_layers, num_single_layers=cfg.num_single_layers, num_refiner_layers=1,
        text_embed_dim=cfg.text_dim, text_embed_2_dim=cfg.glyph_dim, rope_axes_dim=tuple(cfg.rope_axes_dim),
        guidance_embeds=distilled, use_meanflow=distilled,
    )
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.2)
    return model


def tiny_vae(cfg: TinyHunyuanImageConfig) -> Any:
    """An ``AutoencoderKLHunyuanImage`` of ``cfg.vae_channels`` levels (``2 ** (levels - 1)`` x) and a scaling
    factor that is not 1."""
    from diffusers import AutoencoderKLHunyuanImage

    levels = len(cfg.vae_channels)
    return AutoencoderKLHunyuanImage(
        in_channels=3, out_channels=3, latent_channels=cfg.latent_channels, block_out_channels=cfg.vae_channels,
        layers_per_block=1, spatial_compression_ratio=2 ** (levels - 1), sample_size=64, scaling_factor=0.75,
    )


def parts(cfg: TinyHunyuanImageConfig, distilled: bool = False) -> dict[str, tiny.Part]:
    """The pipeline's components of ``cfg``, in build order."""
    from diffusers import AdaptiveProjectedMixGuidance
    from transformers import ByT5Tokenizer

    qwen_tok, byt5_tok = tokenizer(), ByT5Tokenizer()
    found = {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg, distilled)),
        "vae": tiny.Part(lambda: tiny_vae(cfg), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: tiny.qwen25_vl(qwen_tok, cfg.text_dim, cfg.qwen_layers), seed=cfg.seed + 2),
        "text_encoder_2": tiny.Part(lambda: tiny.t5_encoder(byt5_tok, dim=cfg.glyph_dim, heads=2, d_kv=16)),
        "tokenizer": tiny.Part(lambda: qwen_tok),
        "tokenizer_2": tiny.Part(lambda: byt5_tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=4.0 if distilled else 5.0)),
    }
    if not distilled:  # the distilled checkpoint has no guider (no guidance)
        found["guider"] = tiny.Part(lambda: AdaptiveProjectedMixGuidance(
            guidance_scale=3.5, adaptive_projected_guidance_start_step=1, adaptive_projected_guidance_rescale=0.5,
        ))
        found["ocr_guider"] = tiny.Part(lambda: AdaptiveProjectedMixGuidance(
            guidance_scale=3.5, adaptive_projected_guidance_start_step=0, adaptive_projected_guidance_rescale=2.0,
        ))
    return found


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_hunyuan_image` puts the Tencent-layout single file."""
    return tiny.beside(folder, ".original.safetensors")


def write_tiny_hunyuan_image(
    folder: Path, cfg: TinyHunyuanImageConfig | None = None, distilled: bool = False
) -> Path:
    """Save a tiny ``HunyuanImagePipeline`` folder (``distilled``: the guidance-distilled MeanFlow transformer, no
    guider) at ``folder`` and its transformer in Tencent's layout at :func:`original_path`. Returns ``folder``."""
    from diffpipe_hunyuan.original21 import diffusers_to_original

    folder = Path(folder)
    pipe = tiny.write_pipeline("HunyuanImagePipeline", parts(cfg or TinyHunyuanImageConfig(), distilled), folder)
    tiny.save_single_file(diffusers_to_original(pipe.transformer.state_dict()), original_path(folder))
    return folder


def as_distilled(folder: Path, out: Path, cfg: TinyHunyuanImageConfig | None = None) -> Path:
    """Tiny folder ``folder`` copied to ``out`` as the distilled checkpoint's: the guidance-distilled MeanFlow
    transformer of ``cfg`` (its blocks' weights the base's, as a distillation starts), no ``guider/``, the distilled
    scheduler's shift (4); its Tencent-layout file beside it. Returns ``out``."""
    import json
    import shutil

    from diffpipe_hunyuan.original21 import diffusers_to_original

    folder, out = Path(folder), Path(out)
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("guider", "ocr_guider"))
    model = tiny_transformer(cfg or TinyHunyuanImageConfig(), distilled=True)
    base = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    model.load_state_dict(base, strict=False)
    model.save_pretrained(str(out / "transformer"), safe_serialization=True)
    index = json.loads((out / "model_index.json").read_text())
    index.update(guider=[None, None], ocr_guider=[None, None])
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({**scheduler, "shift": 4.0}, indent=2))
    tiny.save_single_file(diffusers_to_original(model.state_dict()), original_path(out))
    return out


def write_tiny_hunyuan_image_distilled(folder: Path) -> Path:
    """The tiny distilled HunyuanImage-2.1 folder (:func:`write_tiny_hunyuan_image` with ``distilled``)."""
    return write_tiny_hunyuan_image(folder, distilled=True)


def load_pipeline(folder: Path) -> Any:
    """The ``HunyuanImagePipeline`` of a tiny folder (float32)."""
    from diffusers import HunyuanImagePipeline

    pipe = HunyuanImagePipeline.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_hunyuan.testing21 FOLDER [--distilled]``: write a tiny HunyuanImage-2.1 (the folder and
    ``FOLDER.original.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    parser.add_argument("--distilled", action="store_true", help="the guidance-distilled MeanFlow transformer")
    args = parser.parse_args(argv)
    write = write_tiny_hunyuan_image_distilled if args.distilled else write_tiny_hunyuan_image
    folder = write(args.folder)
    print(f"wrote {folder} and {original_path(folder)}")


if __name__ == "__main__":
    main()
