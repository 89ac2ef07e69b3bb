"""Write a tiny random-weight Qwen-Image or Qwen-Image-Edit to disk in its real layouts, for tests and benchmarks.

:func:`write_tiny_qwen` saves a diffusers ``QwenImagePipeline`` folder (``model_index.json``, ``transformer/``,
``vae/`` (``AutoencoderKLQwenImage``), ``text_encoder/`` (``Qwen2_5_VLForConditionalGeneration`` with its vision
tower), ``tokenizer/``, ``scheduler/`` with Qwen-Image's scheduler settings), for edit also ``processor/`` (a
``Qwen2VLProcessor``: its image processor and tokenizer) under ``QwenImageEditPipeline`` or
``QwenImageEditPlusPipeline``, and beside it the transformer as one ComfyUI-layout file. The byte-level BPE
tokenizer is trained in-process on the pipelines' prompt templates, so their prefixes are the 34 and 64 tokens the
pipelines drop, as with the real tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.testing import tiny

T2I_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>")
PIPELINES = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")
SCHEDULER = {  # Qwen-Image's scheduler/scheduler_config.json
    "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9, "shift": 1.0,
    "shift_terminal": 0.02, "time_shift_type": "exponential", "use_dynamic_shifting": True,
}


@dataclass
class TinyQwenConfig(tiny.TinySizes):
    """Sizes of the tiny Qwen-Image: a 2-block transformer over 4 latent channels, a 2-layer Qwen2.5-VL
    (``text_dim``: its hidden size = joint_attention_dim)."""

    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)


def tokenizer() -> Any:
    """A Qwen2-like byte-level BPE tokenizer (no BOS, ``<|endoftext|>`` pads, the chat and vision tokens atomic)."""
    texts = [T2I_TEMPLATE.format("a photo of a red cat"), EDIT_TEMPLATE.format("Picture 1: make the dog blue")]
    return tiny.bpe_tokenizer(texts, SPECIALS, "$A", 2048, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def text_encoder(tok: Any, dim: int) -> Any:
    """A tiny ``Qwen2_5_VLForConditionalGeneration``: 2 text layers (multimodal RoPE), a 2-block vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tok.convert_tokens_to_ids(f"<|{token}|>") for name, token in (
        ("image_token_id", "image_pad"), ("video_token_id", "video_pad"), ("vision_start_token_id", "vision_start"),
        ("vision_end_token_id", "vision_end"))}
    text = dict(vocab_size=len(tok), hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(dim // 4)})
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=dim, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, **ids)
    return Qwen2_5_VLForConditionalGeneration(config)


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's multimodal RoPE split of ``head_dim / 2`` frequencies into (time, height, width): ``[1, 1, 2]``
    for the tiny model's head size 8."""
    half = head_dim // 2
    return [half // 4, half // 4, half - 2 * (half // 4)]


def processor(tok: Any) -> Any:
    """The edit pipelines' ``Qwen2VLProcessor`` (images only: see :mod:`diffpipe_core.parts.vl_processors`), its image
    processor sized for tiny images (up to 16 merged patches)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffpipe_core.parts.vl_processors import ImageOnlyProcessor

    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    return ImageOnlyProcessor(image_processor=images, tokenizer=tok, video_processor=None)


def tiny_vae(channels: int) -> Any:
    """An ``AutoencoderKLQwenImage`` (8x spatial) with non-trivial ``latents_mean`` / ``latents_std``."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1 * (i - channels / 2) for i in range(channels)],
        latents_std=[1.0 + 0.25 * i for i in range(channels)],
    )


def tiny_transformer(cfg: TinyQwenConfig, **extra: Any) -> Any:
    """The random-weight diffusers ``QwenImageTransformer2DModel`` of ``cfg`` (2x2 packed latents in); ``extra``:
    further config keys (``zero_cond_t=True``: Qwen-Image-Edit-2511)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(cfg.seed)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * cfg.latent_channels, out_channels=cfg.latent_channels,
        num_layers=cfg.num_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, joint_attention_dim=cfg.text_dim,
        axes_dims_rope=tuple(cfg.axes_dims_rope), **extra,
    )


def parts(cfg: TinyQwenConfig) -> dict[str, tiny.Part]:
    """The ``QwenImagePipeline`` components of ``cfg``, in build order."""
    tok = tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_vae(cfg.latent_channels), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: text_encoder(tok, cfg.text_dim), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(**SCHEDULER)),
    }


def comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_qwen` puts the ComfyUI-layout single file of ``folder``'s transformer."""
    return tiny.beside(folder, "-comfy.safetensors")


def write_tiny_qwen(folder: Path, pipeline: str = "QwenImagePipeline", cfg: TinyQwenConfig | None = None) -> Path:
    """A tiny ``pipeline`` folder (one of :data:`PIPELINES`) and its ComfyUI-layout transformer file beside it
    (:func:`comfy_path`: keys under ``model.diffusion_model.``, as ComfyUI checkpoints hold them)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline {pipeline!r}; valid: {', '.join(PIPELINES)}")
    cfg = cfg or TinyQwenConfig()
    folder = Path(folder)
    pipe = tiny.write_pipeline("QwenImagePipeline", parts(cfg), folder)
    if pipeline != "QwenImagePipeline":  # the processor does not save itself without torchvision: its two halves
        proc = processor(pipe.tokenizer)
        proc.image_processor.save_pretrained(str(folder / "processor"))
        proc.tokenizer.save_pretrained(str(folder / "processor"))
        index = json.loads((folder / "model_index.json").read_text())
        index.update(_class_name=pipeline, processor=["transformers", "Qwen2VLProcessor"])
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    state = {f"model.diffusion_model.{k}": v for k, v in pipe.transformer.state_dict().items()}
    tiny.save_single_file(state, comfy_path(folder))
    return folder


def load_pipeline(folder: Path) -> Any:
    """The diffusers pipeline of a tiny folder (float32), its processor given as
    :func:`~diffpipe_core.parts.vl_processors.load_processor` loads it (diffusers would need torchvision for it)."""
    import diffusers

    from diffpipe_core.parts.vl_processors import load_processor

    folder = Path(folder)
    name = json.loads((folder / "model_index.json").read_text())["_class_name"]
    extra = {"processor": load_processor(folder / "processor")} if (folder / "processor").is_dir() else {}
    return getattr(diffusers, name).from_pretrained(str(folder), dtype=torch.float32, local_files_only=True,
                                                    **extra)


def write_tiny_qwen_edit(folder: Path) -> Path:
    """The tiny Qwen-Image-Edit folder (``qwen-image-edit``: ``QwenImageEditPipeline``)."""
    return write_tiny_qwen(folder, "QwenImageEditPipeline")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_qwenimage.testing FOLDER [--pipeline NAME]``: write a tiny Qwen-Image folder (and
    ``FOLDER-comfy.safetensors``, its transformer in ComfyUI's layout) for a demo."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--pipeline", choices=PIPELINES, default="QwenImagePipeline")
    args = parser.parse_args(argv)
    folder = write_tiny_qwen(args.folder, args.pipeline)
    print(f"wrote {folder} ({args.pipeline}) and {comfy_path(folder)}")


if __name__ == "__main__":
    main()
