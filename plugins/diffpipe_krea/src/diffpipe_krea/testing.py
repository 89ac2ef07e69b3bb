"""Write a tiny random-weight Krea 2 to disk in its real layouts, for tests and benchmarks.

:func:`write_tiny_krea2` saves a diffusers ``Krea2Pipeline`` folder: ``model_index.json`` (the pipeline's config:
``text_encoder_select_layers``, ``is_distilled`` for a Turbo folder), ``transformer/`` (``Krea2Transformer2DModel``),
``vae/`` (Qwen-Image's ``AutoencoderKLQwenImage``), ``text_encoder/`` (a bare ``Qwen3VLModel`` of 36 layers, the core's
tiny builder, so the Turbo modular pipeline's fixed taps 2..35 exist), ``tokenizer/`` (trained in-process on the
pipeline's template), ``scheduler/`` (Krea 2's dynamic shift constants); and beside it the transformer as one file
in Krea's original layout under ``model.diffusion_model.`` (:func:`comfy_path`), as ComfyUI's files hold it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.testing import tiny

PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
#: Krea2Pipeline's default taps of the text encoder's hidden states (the Turbo modular pipeline's fixed ones)
SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


@dataclass
class TinyKrea2Config(tiny.TinySizes):
    """Sizes of the tiny Krea 2: 2 blocks of 2 heads of 16 (1 KV head), 4 VAE channels (16 after 2x2 packing), a
    36-layer Qwen3-VL of width ``text_dim`` whose 12 taps the 2 + 2 text-fusion blocks merge."""

    num_key_value_heads: int = 1
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    text_layers: int = 36


def tokenizer() -> Any:
    """A Qwen2-VL-like tokenizer (the core's) trained on the pipeline's template and a few captions."""
    return tiny.qwen2_vl_tokenizer([PREFIX + "a photo of a red cat" + SUFFIX])


def tiny_transformer(cfg: TinyKrea2Config, **extra: Any) -> Any:
    """The random-weight diffusers ``Krea2Transformer2DModel`` of ``cfg`` (its zero-initialised norms and tables
    given the weights a trained model would have)."""
    from diffusers import Krea2Transformer2DModel

    torch.manual_seed(cfg.seed)
    model = Krea2Transformer2DModel(
        in_channels=cfg.latent_channels * 4, num_layers=cfg.num_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=48, timestep_embed_dim=16, text_hidden_dim=cfg.text_dim, num_text_layers=len(SELECT_LAYERS),
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=48,
        axes_dims_rope=tuple(cfg.axes_dims_rope), **extra,
    )
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.2)
    return model


def tiny_vae(channels: int) -> Any:
    """An ``AutoencoderKLQwenImage`` (8x spatial) with non-trivial ``latents_mean`` / ``latents_std``."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1 * (i - channels / 2) for i in range(channels)],
        latents_std=[1.0 + 0.25 * i for i in range(channels)],
    )


def parts(cfg: TinyKrea2Config) -> dict[str, tiny.Part]:
    """The ``Krea2Pipeline`` components of ``cfg``, in build order."""
    tok = tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_vae(cfg.latent_channels), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: tiny.qwen3_vl(tok, cfg.text_dim, cfg.text_layers, head=False),
                                  seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(
            use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=6400, base_shift=0.5, max_shift=1.15,
            time_shift_type="exponential")),
    }


def comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_krea2` puts the original-layout single file of ``folder``'s transformer."""
    return tiny.beside(folder, "-comfy.safetensors")


def write_tiny_krea2(folder: Path, cfg: TinyKrea2Config | None = None, turbo: bool = False) -> Path:
    """A tiny ``Krea2Pipeline`` folder (``turbo``: ``is_distilled`` in its config, as the Turbo checkpoint's) and
    its original-layout transformer file beside it (:func:`comfy_path`)."""
    from diffpipe_krea.original import layout_for_config

    cfg = cfg or TinyKrea2Config()
    folder = Path(folder)
    pipe = tiny.pipeline("Krea2Pipeline", parts(cfg))
    pipe.save_pretrained(str(folder), safe_serialization=True)
    state = layout_for_config(dict(pipe.transformer.config)).to_original(pipe.transformer.state_dict())
    tiny.save_single_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, comfy_path(folder))
    return as_turbo(folder, folder) if turbo else folder


def write_tiny_krea2_turbo(folder: Path) -> Path:
    """A tiny Krea 2 Turbo folder (:func:`write_tiny_krea2` with ``turbo``)."""
    return write_tiny_krea2(folder, turbo=True)


def as_turbo(folder: Path, out: Path) -> Path:
    """Tiny Krea 2 folder ``folder`` as a Turbo folder at ``out`` (``folder`` itself, or a copy of it):
    ``is_distilled = true`` in its ``model_index.json``."""
    import shutil

    folder, out = Path(folder), Path(out)
    if out != folder:
        shutil.copytree(folder, out, dirs_exist_ok=True)
    index = json.loads((out / "model_index.json").read_text())
    index["is_distilled"] = True
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def load_pipeline(folder: Path) -> Any:
    """The ``Krea2Pipeline`` of a tiny folder (float32)."""
    from diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_krea.testing FOLDER``: write a tiny Krea 2 (the folder and ``FOLDER-comfy.safetensors``,
    the transformer in Krea's original layout)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_krea2(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {comfy_path(folder)}")


if __name__ == "__main__":
    main()
