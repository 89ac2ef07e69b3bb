"""Write a tiny random-weight Qwen-Image 2.1 to disk in its real layouts, for tests and benchmarks.

:func:`write_tiny_qwen21` saves a diffusers ``QwenImage21Pipeline`` folder: ``model_index.json`` (with the pipeline's
``sample_sigmas`` for a Turbo folder), ``transformer/`` (``QwenImage21Transformer2DModel``: single-stream,
block-causal), ``vae/`` (``AutoencoderKLQwenImage21``, 16x spatial), ``text_encoder/`` (the core's tiny
``Qwen3VLForConditionalGeneration``, :func:`~diffpipe_core.testing.tiny.qwen3_vl`), ``processor/`` (a
``Qwen3VLProcessor``: its PIL image processor, tokenizer and chat template), ``scheduler/``; and beside it the
transformer as one ComfyUI file (diffusers names under ``model.diffusion_model.``). The byte-level BPE tokenizer is
trained in-process on the pipeline's prompt template, so the system turn the pipeline drops is one token per word, as
with the real tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.parts.vl_processors import save_processor
from diffpipe_core.testing import tiny

SYSTEM = "Comprehend and analyze the provided prompt."  # QwenImage21Pipeline.sys_prompt
TEMPLATE = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"
#: the tiny Turbo folder's ``sample_sigmas`` (the pipeline's config: the checkpoint's own few-step grid)
TURBO_SIGMAS = [1.0, 0.75, 0.5, 0.25]


@dataclass
class TinyQwen21Config(tiny.TinySizes):
    """Sizes of the tiny Qwen-Image 2.1: a 2-block transformer over 4 latent channels (unpatched: one token per
    latent pixel), a 2-layer Qwen3-VL (``text_dim``: its hidden size = ``context_in_dim``)."""

    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    mlp_ratio: int = 3


def processor() -> Any:
    """A Qwen3-VL processor (:func:`~diffpipe_core.testing.tiny.qwen3_vl_processor`) whose tokenizer is trained on
    the pipeline's template."""
    return tiny.qwen3_vl_processor([TEMPLATE.format("a photo of a red cat")])


def tiny_vae(channels: int) -> Any:
    """An ``AutoencoderKLQwenImage21`` (16x spatial) with non-trivial ``latents_mean`` / ``latents_std``."""
    from diffusers import AutoencoderKLQwenImage21

    return AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=channels, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.1 * (i - channels / 2) for i in range(channels)],
        latents_std=[1.0 + 0.25 * i for i in range(channels)],
    )


def tiny_transformer(cfg: TinyQwen21Config, **extra: Any) -> Any:
    """The random-weight diffusers ``QwenImage21Transformer2DModel`` of ``cfg``; ``extra``: further config keys
    (``causal_condition=False``)."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(cfg.seed)
    model = QwenImage21Transformer2DModel(
        in_channels=cfg.latent_channels, out_channels=cfg.latent_channels, num_layers=cfg.num_layers,
        attention_head_dim=cfg.attention_head_dim, num_attention_heads=cfg.num_attention_heads,
        context_in_dim=cfg.text_dim, mlp_ratio=cfg.mlp_ratio, axes_dims_rope=tuple(cfg.axes_dims_rope), **extra,
    )
    with torch.no_grad():  # the zero-centred norm and zero-initialised parts get weights a trained model would have
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.2)
    return model


def parts(cfg: TinyQwen21Config) -> dict[str, tiny.Part]:
    """The ``QwenImage21Pipeline`` components of ``cfg``, in build order."""
    proc = processor()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_vae(cfg.latent_channels), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: tiny.qwen3_vl(proc.tokenizer, cfg.text_dim), seed=cfg.seed + 2),
        "processor": tiny.Part(lambda: proc),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(use_dynamic_shifting=True, time_shift_type="exponential")),
    }


def comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_qwen21` puts the ComfyUI-layout single file of ``folder``'s transformer."""
    return tiny.beside(folder, "-comfy.safetensors")


def write_tiny_qwen21(folder: Path, cfg: TinyQwen21Config | None = None, turbo: bool = False) -> Path:
    """A tiny ``QwenImage21Pipeline`` folder (``turbo``: with ``sample_sigmas`` in ``model_index.json``, as the
    Turbo checkpoint's config carries its grid) and its ComfyUI-layout transformer file beside it
    (:func:`comfy_path`)."""
    cfg = cfg or TinyQwen21Config()
    folder = Path(folder)
    pipe = tiny.pipeline("QwenImage21Pipeline", parts(cfg))
    proc = pipe.processor  # it does not save itself without torchvision: its image processor, tokenizer, template
    pipe.register_modules(processor=None)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    save_processor(proc, folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    state = {f"model.diffusion_model.{k}": v for k, v in pipe.transformer.state_dict().items()}
    tiny.save_single_file(state, comfy_path(folder))
    return as_turbo(folder, folder) if turbo else folder


def write_tiny_qwen21_turbo(folder: Path) -> Path:
    """The tiny Qwen-Image 2.1 Turbo folder (``qwen-image-2.1-turbo``: ``sample_sigmas`` in ``model_index.json``)."""
    return write_tiny_qwen21(folder, turbo=True)


def as_turbo(folder: Path, out: Path) -> Path:
    """Tiny Qwen-Image 2.1 folder ``folder`` as a Turbo folder at ``out`` (``folder`` itself, or a copy of it):
    :data:`TURBO_SIGMAS` as ``sample_sigmas`` in its ``model_index.json``."""
    import shutil

    folder, out = Path(folder), Path(out)
    if out != folder:
        shutil.copytree(folder, out, dirs_exist_ok=True)
    index = json.loads((out / "model_index.json").read_text())
    index["sample_sigmas"] = TURBO_SIGMAS
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def load_pipeline(folder: Path) -> Any:
    """The ``QwenImage21Pipeline`` of a tiny folder (float32), its processor loaded without torchvision."""
    from diffusers import QwenImage21Pipeline

    from diffpipe_core.parts.vl_processors import ImageOnlyQwen3VLProcessor, load_processor

    processor = load_processor(Path(folder) / "processor", ImageOnlyQwen3VLProcessor)
    return QwenImage21Pipeline.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True,
                                               processor=processor)
