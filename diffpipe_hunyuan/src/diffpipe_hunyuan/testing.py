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

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpipe_core.testing.tokenizers import word_level_tokenizer

CAPTION_WORDS = (
    "a photo video of cat dog red blue green house tree sky with on in the small large bright dark river "
    "mountain city car person walks runs flies slowly quickly 0 1 2 3 4 5 6 7 8 9"
).split()
LLAMA_SPECIALS = ["<pad>", "<unk>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


@dataclass
class TinyHunyuanConfig:
    """Sizes of the tiny HunyuanVideo (``guidance_embeds=True`` like the released, guidance-distilled model)."""

    num_layers: int = 2
    num_single_layers: int = 2
    num_refiner_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    patch_size: int = 2
    latent_channels: int = 4
    guidance_embeds: bool = True
    text_dim: int = 32  # Llama hidden size = text_embed_dim
    clip_dim: int = 32  # CLIP hidden size = pooled_projection_dim
    llama_layers: int = 3  # the pipeline takes hidden_states[-3]
    vae_channels: tuple[int, ...] = field(default=(8, 8, 8, 8))  # 4 levels: 8x spatial, 4x temporal
    seed: int = 0


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
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    return word_level_tokenizer(
        CAPTION_WORDS, specials, "<s> $A </s>", 77, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


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


def tiny_pipeline(cfg: TinyHunyuanConfig):
    """A complete random-weight ``HunyuanVideoPipeline`` (not yet on disk)."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    transformer = tiny_transformer(cfg)
    torch.manual_seed(cfg.seed + 1)
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=cfg.latent_channels,
        block_out_channels=cfg.vae_channels,
        layers_per_block=1,
        norm_num_groups=min(cfg.vae_channels) // 2,
    )
    llama_tok, clip_tok = llama_tokenizer(), clip_tokenizer()
    llama = LlamaModel(
        LlamaConfig(
            vocab_size=len(llama_tok),
            hidden_size=cfg.text_dim,
            intermediate_size=2 * cfg.text_dim,
            num_hidden_layers=cfg.llama_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            pad_token_id=llama_tok.pad_token_id,
            bos_token_id=llama_tok.bos_token_id,
            eos_token_id=llama_tok.eos_token_id,
        )
    )
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=cfg.clip_dim,
            intermediate_size=2 * cfg.clip_dim,
            num_attention_heads=2,
            num_hidden_layers=2,
            max_position_embeddings=77,
            projection_dim=cfg.clip_dim,
            pad_token_id=clip_tok.pad_token_id,
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
        )
    )
    return HunyuanVideoPipeline(
        text_encoder=llama.eval(),
        tokenizer=llama_tok,
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip.eval(),
        tokenizer_2=clip_tok,
    )


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_hunyuan` puts the original-layout single file by default."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".original.safetensors")


def write_tiny_hunyuan(folder: Path, cfg: TinyHunyuanConfig | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny HunyuanVideo pipeline folder at ``folder`` and its transformer in the original Tencent layout
    at ``single_file`` (default :func:`original_path`). Returns ``folder``."""
    from safetensors.torch import save_file

    from diffpipe_hunyuan.original import diffusers_to_original

    cfg = cfg or TinyHunyuanConfig()
    folder = Path(folder)
    pipe = tiny_pipeline(cfg)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    state = {k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}
    save_file(diffusers_to_original(state), str(single_file or original_path(folder)), metadata={"format": "pt"})
    return folder


def apply_comfyui_lora(original: dict[str, torch.Tensor], comfy: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original-layout weights with a ComfyUI-format LoRA merged the way ComfyUI merges it: for each module,
    ``W += alpha / rows(lora_A) * lora_B @ lora_A`` (ComfyUI's native names mapped to the original ones)."""
    from diffpipe_hunyuan.original import maps_for_original_keys

    names = {m.comfy: m.original for m in maps_for_original_keys(list(original)) if m.comfy is not None}
    out = dict(original)
    for key, down in comfy.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            up, alpha = comfy[f"{module}.lora_B.weight"], float(comfy[f"{module}.alpha"])
            weight = f"{names[module.removeprefix('diffusion_model.')]}.weight"
            out[weight] = out[weight] + alpha / down.shape[0] * up @ down
    return out


def _codec() -> str:
    import av

    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except Exception:
        return "mpeg4"


def write_clip(path: Path, frames: int, fps: int = 8, size: tuple[int, int] = (64, 64), seed: int = 0) -> Path:
    """A short mp4 at ``path``: a smooth random colour field (``size`` = width, height) drifting sideways."""
    import av
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    coarse = rng.integers(0, 256, size=(4, 8, 3), dtype=np.uint8)
    field_ = np.asarray(Image.fromarray(coarse).resize((2 * w, h), Image.BILINEAR))
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(_codec(), rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            frame = np.ascontiguousarray(field_[:, (2 * i) % w : (2 * i) % w + w])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_clip_dataset(
    folder: Path, frames: Sequence[int], captions: Sequence[str], size: tuple[int, int] = (64, 64), fps: int = 8
) -> list[Path]:
    """``clip_000.mp4``... with ``.txt`` captions in ``folder``, one clip per entry of ``frames``."""
    paths = []
    for i, (n, caption) in enumerate(zip(frames, captions, strict=True)):
        path = write_clip(folder / f"clip_{i:03d}.mp4", n, fps, size, seed=i)
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_hunyuan.testing FOLDER [--clips DIR]``: write a tiny HunyuanVideo (the folder and
    ``FOLDER.original.safetensors``) and, with ``--clips``, a few captioned demo clips."""
    from diffpipe_core.quiet import quiet_script

    quiet_script()  # the libraries' chatter stays behind DIFFPIPE_VERBOSE=1, as in the CLI
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--clips", type=Path, help="also write 4 short captioned mp4 clips (24 fps) here")
    args = parser.parse_args(argv)
    folder = write_tiny_hunyuan(args.folder)
    print(f"wrote {folder} and {original_path(folder)}")
    if args.clips:
        captions = ["a red car", "a blue river", "a green tree", "a dark city"]
        write_clip_dataset(args.clips, [10, 10, 18, 18], captions, size=(64, 64), fps=24)
        print(f"wrote 4 clips to {args.clips}")
    print(f"its tokenizer needs [model] text_crop_start = {template_crop_start(llama_tokenizer())}")


if __name__ == "__main__":
    main()
