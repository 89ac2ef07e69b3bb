"""Write a tiny random-weight HunyuanVideo-1.5 to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_hunyuan15` saves a complete diffusers ``HunyuanVideo15Pipeline`` folder (or, with ``i2v``, a
``HunyuanVideo15ImageToVideoPipeline`` one: ``image_encoder/`` (``SiglipVisionModel``) and ``feature_extractor/``
too): ``transformer/``, ``vae/`` (``AutoencoderKLHunyuanVideo15``, 16x spatial), ``text_encoder/``
(``Qwen2_5_VLTextModel``), ``tokenizer/`` (a Qwen2-like BPE with a chat template), ``text_encoder_2/`` (a T5
encoder), ``tokenizer_2/`` (``ByT5Tokenizer``), ``scheduler/``, ``guider/``; and, beside it, the same transformer as
one safetensors file in Tencent's key layout (``double_blocks.0.img_attn_q.weight``, ...). Everything is built
in-process.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.testing import tiny

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PIPELINES = {False: "HunyuanVideo15Pipeline", True: "HunyuanVideo15ImageToVideoPipeline"}


@dataclass
class TinyHunyuan15Config(tiny.TinySizes):
    """Sizes of the tiny HunyuanVideo-1.5 (``text_dim``: the Qwen2.5-VL hidden size = text_embed_dim; ``glyph_dim``:
    the ByT5 width; ``image_dim``: SigLIP's width; ``target_size``: the pipeline's default sample size in pixels)."""

    num_refiner_layers: int = 1
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    glyph_dim: int = 24
    image_dim: int = 16
    qwen_layers: int = 3  # the pipeline takes hidden_states[-3]
    vae_channels: tuple[int, ...] = (8, 8, 8, 8, 8)  # 5 levels: 16x spatial, 4x temporal
    target_size: int = 32


def _pipeline_system_message() -> str:
    """The pipeline's system message (the default of its ``_get_mllm_prompt_embeds``, the text its constructor sets)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def template_prefix(tokenizer: Any) -> str:
    """The chat-formatted prompt up to the caption (system message and user header)."""
    messages = [{"role": "system", "content": _pipeline_system_message()}, {"role": "user", "content": "{}"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text.split("{}")[0]


@cache
def qwen_tokenizer() -> Any:
    """A Qwen2-like byte-level BPE tokenizer (``<|endoftext|>`` pads) with Qwen2.5's chat-message format, trained on
    the pipeline's system message and :data:`diffpipe_core.testing.tiny.WORDS` (trained once per process: treat it as
    read-only)."""
    system = _pipeline_system_message()
    texts = [f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n a photo <|im_end|>\n", " ".join(tiny.WORDS)]
    tok = tiny.bpe_tokenizer(
        texts, SPECIALS, "$A", 4096, split=tiny.QWEN2_SPLIT, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def template_crop_start(tokenizer: Any) -> int:
    """How many tokens ``tokenizer`` makes of the chat template before the caption: the ``text_crop_start`` a model
    with this tokenizer needs (108 for Qwen2.5-VL's)."""
    return len(tokenizer(template_prefix(tokenizer))["input_ids"])


def qwen_text(tok: Any, dim: int, layers: int) -> Any:
    """A tiny ``Qwen2_5_VLTextModel`` (the text half of Qwen2.5-VL, multimodal RoPE over text positions)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    half = dim // 4 // 2  # head dim 8 -> 4 frequencies over (time, height, width)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [half // 4, half // 4, half - 2 * (half // 4)]}
    config = Qwen2_5_VLTextConfig(
        vocab_size=len(tok), hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, rope_parameters=rope,
    )
    return Qwen2_5_VLTextModel(config)


def tiny_transformer(cfg: TinyHunyuan15Config, task: str = "t2v") -> Any:
    """The random-weight diffusers ``HunyuanVideo15Transformer3DModel`` of ``cfg`` (latents, condition latents and
    mask in: ``2 C + 1`` channels)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(cfg.seed)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=2 * cfg.latent_channels + 1, out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads, attention_head_dim=cfg.attention_head_dim,
        num_layers=cfg.num_layers, num_refiner_layers=cfg.num_refiner_layers, text_embed_dim=cfg.text_dim,
        text_embed_2_dim=cfg.glyph_dim, image_embed_dim=cfg.image_dim, rope_axes_dim=tuple(cfg.rope_axes_dim),
        target_size=cfg.target_size, task_type=task,
    )
    with torch.no_grad():  # the released model's is trained; a zero one (its init) would hide the token types
        model.cond_type_embed.weight.normal_(0, 0.5)
    return model


def parts(cfg: TinyHunyuan15Config, i2v: bool = False) -> dict[str, tiny.Part]:
    """The pipeline's components of ``cfg``, in build order."""
    from diffusers import AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance
    from transformers import ByT5Tokenizer

    qwen_tok, byt5_tok = qwen_tokenizer(), ByT5Tokenizer()
    vae = dict(latent_channels=cfg.latent_channels, block_out_channels=cfg.vae_channels, layers_per_block=1)
    found = {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg, "i2v" if i2v else "t2v")),
        "vae": tiny.Part(lambda: AutoencoderKLHunyuanVideo15(**vae), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: qwen_text(qwen_tok, cfg.text_dim, cfg.qwen_layers)),
        "text_encoder_2": tiny.Part(lambda: tiny.t5_encoder(byt5_tok, dim=cfg.glyph_dim, heads=2, d_kv=12)),
        "tokenizer": tiny.Part(lambda: qwen_tok),
        "tokenizer_2": tiny.Part(lambda: byt5_tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=5.0)),
        "guider": tiny.Part(lambda: ClassifierFreeGuidance(guidance_scale=6.0)),
    }
    if i2v:
        found["image_encoder"] = tiny.Part(lambda: siglip(cfg.image_dim, cfg.target_size))
        found["feature_extractor"] = tiny.Part(lambda: siglip_processor(cfg.target_size))
    return found


def siglip(dim: int, size: int) -> Any:
    """A tiny ``SiglipVisionModel``: ``(size / 8)^2`` tokens of ``dim``."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    return SiglipVisionModel(SiglipVisionConfig(
        hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=1, num_attention_heads=2, image_size=size,
        patch_size=8,
    ))


def siglip_processor(size: int) -> Any:
    from transformers import SiglipImageProcessor

    return SiglipImageProcessor(size={"height": size, "width": size})


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_hunyuan15` puts the Tencent-layout single file by default."""
    return tiny.beside(folder, ".original.safetensors")


def write_tiny_hunyuan15(folder: Path, cfg: TinyHunyuan15Config | None = None, i2v: bool = False) -> Path:
    """Save a tiny HunyuanVideo-1.5 (``i2v``: image-to-video) pipeline folder at ``folder`` and its transformer in
    Tencent's layout at :func:`original_path`. Returns ``folder``."""
    from diffpipe_hunyuan.original15 import diffusers_to_original

    folder = Path(folder)
    pipe = tiny.write_pipeline(PIPELINES[i2v], parts(cfg or TinyHunyuan15Config(), i2v), folder)
    tiny.save_single_file(diffusers_to_original(pipe.transformer.state_dict()), original_path(folder))
    return folder


def write_tiny_hunyuan15_i2v(folder: Path) -> Path:
    """The tiny HunyuanVideo-1.5 image-to-video folder (``hunyuan-video-1.5-i2v``)."""
    return write_tiny_hunyuan15(folder, i2v=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_hunyuan.testing15 FOLDER [--i2v]``: write a tiny HunyuanVideo-1.5 (the folder and
    ``FOLDER.original.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    parser.add_argument("--i2v", action="store_true", help="an image-to-video pipeline (with SigLIP)")
    args = parser.parse_args(argv)
    folder = write_tiny_hunyuan15(args.folder, i2v=args.i2v)
    print(f"wrote {folder} and {original_path(folder)}")
    print(f"its tokenizer needs [model] text_crop_start = {template_crop_start(qwen_tokenizer())}")


if __name__ == "__main__":
    main()
