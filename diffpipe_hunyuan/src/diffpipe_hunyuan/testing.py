"""Write a tiny random-weight HunyuanVideo to disk in its real layouts, plus short test clips, for tests, the
demo and benchmarks.

:func:`write_tiny_hunyuan` saves a complete diffusers ``HunyuanVideoPipeline`` folder (``model_index.json``,
``transformer/``, ``vae/`` (``AutoencoderKLHunyuanVideo``), ``text_encoder/`` (``LlamaModel``), ``tokenizer/``,
``text_encoder_2/`` (CLIP-L-like), ``tokenizer_2/``, ``scheduler/``) and, beside it, the same transformer as
one safetensors file in the original Tencent key layout (``double_blocks.0.img_attn_qkv.weight``, ...), as
HunyuanVideo checkpoints are downloaded. Tokenizers are built in-process (no hub access); the Llama one knows
the words of diffusers' prompt template, whose prefix it cuts into :func:`template_crop_start` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.testing import tiny
from diffpipe_core.testing.tokenizers import word_level_tokenizer

CAPTION_WORDS = (
    "a photo video of cat dog red blue green house tree sky with on in the small large bright dark river "
    "mountain city car person walks runs flies slowly quickly 0 1 2 3 4 5 6 7 8 9"
).split()
LLAMA_SPECIALS = ["<pad>", "<unk>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


@dataclass
class TinyHunyuanConfig(tiny.TinySizes):
    """Sizes of the tiny HunyuanVideo (``guidance_embeds=True`` like the released, guidance-distilled model;
    ``text_dim``: Llama hidden size = text_embed_dim)."""

    num_single_layers: int = 2
    num_refiner_layers: int = 1
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    patch_size: int = 2
    guidance_embeds: bool = True
    clip_dim: int = 32  # CLIP hidden size = pooled_projection_dim
    llama_layers: int = 3  # the pipeline takes hidden_states[-3]
    vae_channels: tuple[int, ...] = field(default=(8, 8, 8, 8))  # 4 levels: 8x spatial, 4x temporal


def _prompt_template() -> str:
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return DEFAULT_PROMPT_TEMPLATE["template"]


def llama_tokenizer():
    """A Llama-3-like tokenizer (BOS first, the template's header tokens atomic) over the template's words."""
    from tokenizers import pre_tokenizers

    template = _prompt_template()
    for special in LLAMA_SPECIALS:
        template = template.replace(special, " ")
    words = [w.lower() for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(template.replace("{}", " "))]
    return word_level_tokenizer(
        words + CAPTION_WORDS,
        LLAMA_SPECIALS,
        "<|begin_of_text|> $A",
        4096,
        pad_token="<pad>",
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )


def clip_tokenizer():
    return tiny.clip_tokenizer(CAPTION_WORDS, ("<pad>", "<unk>", "<s>", "</s>"))


def template_crop_start(tokenizer: Any) -> int:
    """How many tokens ``tokenizer`` makes of the prompt template before the caption (BOS included): the
    ``text_crop_start`` a model with this tokenizer needs (95 for HunyuanVideo's Llama-3 tokenizer)."""
    prefix = _prompt_template().split("{}")[0]
    return len(tokenizer(prefix)["input_ids"])


def tiny_transformer(cfg: TinyHunyuanConfig):
    """The random-weight diffusers ``HunyuanVideoTransformer3DModel`` of ``cfg``."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(cfg.seed)
    return HunyuanVideoTransformer3DModel(
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        num_refiner_layers=cfg.num_refiner_layers,
        patch_size=cfg.patch_size,
        patch_size_t=1,
        guidance_embeds=cfg.guidance_embeds,
        text_embed_dim=cfg.text_dim,
        pooled_projection_dim=cfg.clip_dim,
        rope_axes_dim=tuple(cfg.rope_axes_dim),
    )


def parts(cfg: TinyHunyuanConfig) -> dict[str, tiny.Part]:
    """The ``HunyuanVideoPipeline`` components of ``cfg``, in build order."""
    from diffusers import AutoencoderKLHunyuanVideo

    llama_tok, clip_tok = llama_tokenizer(), clip_tokenizer()
    vae = dict(block_out_channels=cfg.vae_channels, layers_per_block=1, norm_num_groups=min(cfg.vae_channels) // 2)
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(
            lambda: AutoencoderKLHunyuanVideo(latent_channels=cfg.latent_channels, **vae), seed=cfg.seed + 1
        ),
        "text_encoder": tiny.Part(lambda: tiny.llama(llama_tok, cfg.text_dim, cfg.llama_layers)),
        "text_encoder_2": tiny.Part(lambda: tiny.clip_text(clip_tok, cfg.clip_dim)),
        "tokenizer": tiny.Part(lambda: llama_tok),
        "tokenizer_2": tiny.Part(lambda: clip_tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=7.0)),
    }


def tiny_pipeline(cfg: TinyHunyuanConfig):
    """A complete random-weight ``HunyuanVideoPipeline`` (not yet on disk)."""
    return tiny.pipeline("HunyuanVideoPipeline", parts(cfg))


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_hunyuan` puts the original-layout single file by default."""
    return tiny.beside(folder, ".original.safetensors")


def write_tiny_hunyuan(folder: Path, cfg: TinyHunyuanConfig | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny HunyuanVideo pipeline folder at ``folder`` and its transformer in the original Tencent layout
    at ``single_file`` (default :func:`original_path`). Returns ``folder``."""
    from diffpipe_hunyuan.original import diffusers_to_original

    folder = Path(folder)
    pipe = tiny.write_pipeline("HunyuanVideoPipeline", parts(cfg or TinyHunyuanConfig()), folder)
    tiny.save_single_file(
        diffusers_to_original(pipe.transformer.state_dict()), Path(single_file or original_path(folder))
    )
    return folder


def apply_comfyui_lora(original: dict[str, torch.Tensor], comfy: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original-layout weights with a ComfyUI-format LoRA merged the way ComfyUI merges it (ComfyUI's native names
    mapped to the original ones): :func:`diffpipe_core.testing.runs.apply_comfyui`."""
    from diffpipe_core.testing.runs import apply_comfyui
    from diffpipe_hunyuan.original import layout_for_original_keys

    table = layout_for_original_keys(original)
    return apply_comfyui(original, comfy, names={m.comfy_name: m.original for m in table.modules if m.comfy_name})


def write_clip_dataset(folder: Path, frames, captions, size: tuple[int, int] = (64, 64), fps: int = 8) -> list[Path]:
    """``clip_000.mp4``... (a drifting colour field) with ``.txt`` captions, one per entry of ``frames``."""
    from diffpipe_core.testing.media import write_clip_dataset as write

    return write(folder, list(frames), list(captions), size, fps, drifting=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_hunyuan.testing FOLDER [--clips DIR]``: write a tiny HunyuanVideo (the folder and
    ``FOLDER.original.safetensors``) and, with ``--clips``, a few captioned demo clips."""
    parser = tiny.folder_parser(main.__doc__)
    parser.add_argument("--clips", type=Path, help="also write 4 short captioned mp4 clips (24 fps) here")
    args = parser.parse_args(argv)
    folder = write_tiny_hunyuan(args.folder)
    print(f"wrote {folder} and {original_path(folder)}")
    if args.clips:
        captions = ["a red car", "a blue river", "a green tree", "a dark city"]
        write_clip_dataset(args.clips, [10, 10, 18, 18], captions, size=(64, 64), fps=24)
        print(f"wrote 4 clips to {args.clips}")
    print(f"its tokenizer needs [model] text_crop_start = {template_crop_start(llama_tokenizer())}")


def tiny_config(path: Path, crop: int, **keys: Any) -> Any:
    """The validated ``[model]`` table of the tiny HunyuanVideo at ``path`` in float32 (16 Llama tokens after the
    template's ``crop`` tokens), plus ``keys``."""
    from diffpipe_core.schema import validate
    from diffpipe_hunyuan.config import HunyuanConfig

    table = {"type": "hunyuan-video", "path": path, "dtype": "float32", "encoder_dtype": "float32"}
    return validate(HunyuanConfig, {**table, "text_max_length": 16, "text_crop_start": crop, **keys}, "test")


if __name__ == "__main__":
    main()
