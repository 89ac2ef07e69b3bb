"""Tiny random-weight OmniGen2 models for tests, the demo and the bench.

:data:`TINY_TRANSFORMER` and :func:`seeded_weights` define the tiny transformer the reference fixture was computed on
(``tests/make_reference_fixture.py``); :func:`write_tiny_omnigen2` saves a complete folder in the released layout
(``model_index.json`` of ``OmniGen2Pipeline``, ``transformer/``, ``vae/`` (``AutoencoderKL`` with FLUX.1's scaling
and shift), ``mllm/`` (``Qwen2_5_VLForConditionalGeneration``), ``processor/`` (its tokenizer with Qwen's chat
template), ``scheduler/``).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

#: the tiny transformer's config (2 query heads of 16 = rotary axes 4 + 6 + 6, 1 key/value head)
TINY_TRANSFORMER: dict[str, Any] = {
    "patch_size": 2, "in_channels": 4, "hidden_size": 32, "num_layers": 2, "num_refiner_layers": 1,
    "num_attention_heads": 2, "num_kv_heads": 1, "multiple_of": 16, "axes_dim_rope": (4, 6, 6),
    "axes_lens": (160, 160, 160), "text_feat_dim": 32, "timestep_scale": 1000.0,
}  # fmt: skip

#: Qwen2.5-VL's chat template for text messages (the system turn given), as OmniGen2Pipeline applies it
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>")


SAMPLE_SEED = 5  # the sampling comparison's seed


def seeded_weights(state: dict[str, torch.Tensor], scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` drawn from its own seed (the CRC32 of its name): ``scale * N(0, 1)``, plus 1 for norm
    weights. The same names give the same weights in the reference model and in diffpipe's."""
    out = {}
    for name, value in state.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        w = scale * torch.randn(value.shape, generator=g, dtype=torch.float64)
        if "norm" in name and name.endswith("weight") and value.dim() == 1:
            w = w + 1.0
        out[name] = w.to(value.dtype)
    return out


def reference_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """The fixture's inputs: two samples (captions of 5 and 7 tokens, times 0.3 and 0.8) on an 8x6 latent, two
    reference latents for the first sample, a 3-token negative caption, and the 8x8 noise diffpipe's sampling loop
    draws for seed :data:`SAMPLE_SEED` (``noise_generator(SAMPLE_SEED, 0)``)."""
    from diffpipe_core.sampling.loop import noise_generator

    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:] = 0
    return {
        "latents": torch.randn(2, 4, 8, 6, generator=g), "t": torch.tensor([0.3, 0.8]),
        "text": torch.randn(2, 7, 32, generator=g), "mask": mask,
        "ref0": torch.randn(4, 4, 6, generator=g), "ref1": torch.randn(4, 6, 4, generator=g),
        "negative": torch.randn(1, 3, 32, generator=g), "negative_mask": torch.ones(1, 3, dtype=torch.long),
        "noise": torch.randn(1, 4, 8, 8, generator=noise_generator(SAMPLE_SEED, 0)),
    }  # fmt: skip


def tiny_transformer(seed: int = 0, **changes: Any) -> Any:
    """diffpipe's tiny :class:`~diffpipe_omnigen.model.OmniGen2Transformer2DModel`, weights from
    :func:`seeded_weights` (``seed`` shifts the scale's sign pattern only through the names: kept for symmetry)."""
    from diffpipe_omnigen.model import OmniGen2Transformer2DModel

    model = OmniGen2Transformer2DModel(**{**TINY_TRANSFORMER, **changes})
    model.load_state_dict(seeded_weights(model.state_dict()))
    return model.eval()


def tokenizer() -> Any:
    """A Qwen2-like byte-level BPE tokenizer (``<|endoftext|>`` pads on the right, chat tokens atomic) with Qwen's
    chat template, trained on the pipeline's chat prompt."""
    from diffpipe_core.testing import tiny
    from diffpipe_omnigen.config import SYSTEM_PROMPT

    texts = [f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\na photo of a red cat<|im_end|>\n",
             " ".join(tiny.WORDS)]
    tok = tiny.bpe_tokenizer(texts, SPECIALS, "$A", 2048, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def mllm(tok: Any, dim: int = 32) -> Any:
    """A tiny ``Qwen2_5_VLForConditionalGeneration`` (2 text layers, a 2-block vision tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tok.convert_tokens_to_ids(f"<|{token}|>") for name, token in (
        ("image_token_id", "image_pad"), ("video_token_id", "video_pad"), ("vision_start_token_id", "vision_start"),
        ("vision_end_token_id", "vision_end"))}
    half = dim // 8  # head_dim / 2 frequencies split (time, height, width)
    text = dict(vocab_size=len(tok), hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": [half // 4, half // 4, half - 2 * (half // 4)]})
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=dim, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, **ids)
    return Qwen2_5_VLForConditionalGeneration(config)


#: the released scheduler/scheduler_config.json (OmniGen2's own FlowMatchEulerDiscreteScheduler)
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "dynamic_time_shift": True}


def write_tiny_omnigen2(folder: Path, single_file: Path | None = None, transformer: dict[str, Any] | None = None,
                        latent_channels: int = 4) -> Path:
    """Save a tiny OmniGen2 folder at ``folder`` (the released layout; see the module docstring) and its transformer
    as one ComfyUI-style file (keys under ``model.diffusion_model.``) at ``single_file`` (default
    :func:`comfy_path`). ``transformer``: config keys other than :data:`TINY_TRANSFORMER`'s (its ``text_feat_dim`` is
    the text encoder's width); ``latent_channels``: the VAE's (= ``in_channels``). Returns ``folder``."""
    import diffusers

    from diffpipe_core.testing import tiny

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    changes = {**(transformer or {}), "in_channels": latent_channels}
    model = tiny_transformer(**changes)
    model.save_pretrained(str(folder / "transformer"), safe_serialization=True)
    torch.manual_seed(1)
    vae = tiny.autoencoder_kl(latent_channels, scaling_factor=0.3611, shift_factor=0.1159)
    vae.save_pretrained(str(folder / "vae"))
    torch.manual_seed(2)
    mllm(tok, int(model.config.text_feat_dim)).save_pretrained(str(folder / "mllm"))
    tok.save_pretrained(str(folder / "processor"))
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=2) + "\n")
    index = {
        "_class_name": "OmniGen2Pipeline", "_diffusers_version": diffusers.__version__,
        "mllm": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "processor": ["transformers", "Qwen2_5_VLProcessor"],
        "scheduler": ["omnigen2.schedulers.scheduling_flow_match_euler_discrete", "FlowMatchEulerDiscreteScheduler"],
        "transformer": ["omnigen2.models.transformers.transformer_omnigen2", "OmniGen2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }  # fmt: skip
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    state = {f"model.diffusion_model.{k}": v for k, v in model.state_dict().items()}
    tiny.save_single_file(state, Path(single_file or comfy_path(folder)))
    return folder


def comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_omnigen2` puts the ComfyUI-style transformer file of ``folder``."""
    from diffpipe_core.testing import tiny

    return tiny.beside(folder, "-comfy.safetensors")


def tiny_config(path: Path, **keys: Any) -> Any:
    """The validated ``[model]`` table of the tiny OmniGen2 at ``path`` in float32 (64 tokens), plus ``keys``."""
    from diffpipe_core.schema import validate
    from diffpipe_omnigen.config import OmniGen2Config

    table = {"type": "omnigen2", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 64}
    return validate(OmniGen2Config, {**table, **keys}, "test")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_omnigen.testing FOLDER``: write a tiny OmniGen2 (the folder and its ComfyUI-style
    transformer file beside it)."""
    from diffpipe_core.testing import tiny

    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_omnigen2(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {comfy_path(folder)}")


if __name__ == "__main__":
    main()
