"""Write a tiny random-weight HiDream-I1 to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_hidream` saves a complete diffusers ``HiDreamImagePipeline`` folder (``model_index.json``,
``transformer/`` (a ``HiDreamImageTransformer2DModel`` of 2 double- and 2 single-stream blocks with 4 routed experts,
2 active, and a shared one; Llama layers ``[0, 1, 2, 2]`` as the release repeats its last), ``vae/`` (``AutoencoderKL``
with FLUX.1's scaling and shift), ``text_encoder/`` and ``text_encoder_2/`` (``CLIPTextModelWithProjection``),
``text_encoder_3/`` (``T5EncoderModel``), ``text_encoder_4/`` (``LlamaForCausalLM``), the four tokenizers,
``scheduler/``) and, beside it, the same transformer as one safetensors file as ComfyUI holds it (diffusers' names
under ``model.diffusion_model.``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffpipe_core.testing import tiny

PREFIX = "model.diffusion_model."  # where a checkpoint saved by ComfyUI holds the transformer
LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")


@dataclass
class TinyHiDreamConfig(tiny.TinySizes):
    """Sizes of the tiny HiDream: width 32 = 2 heads x 16 (rotary axes 8 + 4 + 4); CLIP-L 16 and CLIP-G 32 wide
    (pooled: 48), T5 and Llama 32 and 24 wide; a 3-layer Llama; ``max_resolution`` (8, 8) latents: 16 patches, the
    length non-square latents are padded to."""

    num_single_layers: int = 2
    text_dim: int = 32
    llama_dim: int = 24
    llama_layers: tuple[int, ...] = (0, 1, 2, 2)
    llama_depth: int = 3
    clip_l_dim: int = 16
    clip_g_dim: int = 32
    num_routed_experts: int = 4
    max_resolution: tuple[int, int] = (8, 8)
    scheduler: dict[str, Any] = field(default_factory=lambda: {"shift": 3.0})


def llama_tokenizer() -> Any:
    """A Llama-3-like byte-level BPE tokenizer (Llama 3's pre-tokenizer split, BOS first, EOS as padding, as
    ``HiDreamImagePipeline`` sets it)."""
    return tiny.bpe_tokenizer(
        [" ".join(tiny.WORDS)], LLAMA_SPECIALS, "<|begin_of_text|> $A", 512, split=tiny.LLAMA3_SPLIT,
        bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|end_of_text|>",
    )


def tiny_transformer(cfg: TinyHiDreamConfig) -> Any:
    """The random-weight diffusers ``HiDreamImageTransformer2DModel`` of ``cfg``."""
    import torch
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(cfg.seed)
    third = cfg.attention_head_dim // 4
    return HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=cfg.latent_channels, out_channels=cfg.latent_channels, num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, caption_channels=[cfg.text_dim, cfg.llama_dim],
        text_emb_dim=cfg.clip_l_dim + cfg.clip_g_dim, num_routed_experts=cfg.num_routed_experts,
        num_activated_experts=2, axes_dims_rope=(2 * third, third, third), max_resolution=cfg.max_resolution,
        llama_layers=list(cfg.llama_layers),
    )


def tiny_llama(tokenizer: Any, cfg: TinyHiDreamConfig) -> Any:
    """A ``LlamaForCausalLM`` (Llama 3.1's class, of which the pipeline reads the hidden states)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    keys = {"bos_token_id": tokenizer.bos_token_id}
    return LlamaForCausalLM(tiny.decoder_config(LlamaConfig, tokenizer, cfg.llama_dim, cfg.llama_depth, **keys))


def scheduler(config: dict[str, Any]) -> Any:
    """The folder's scheduler: ``UniPCMultistepScheduler`` with flow sigmas when ``config`` has ``flow_shift``,
    else ``FlowMatchEulerDiscreteScheduler``."""
    from diffusers import UniPCMultistepScheduler

    if "flow_shift" in config:
        return UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", **config)
    return tiny.flow_scheduler(**config)


def parts(cfg: TinyHiDreamConfig) -> dict[str, tiny.Part]:
    """The ``HiDreamImagePipeline`` components of ``cfg``, in build order."""
    clip, t5, llama = tiny.clip_tokenizer(), tiny.t5_tokenizer(), llama_tokenizer()
    clip_text = lambda dim: tiny.clip_text(clip, dim, projection=True, max_positions=248)  # noqa: E731  (HiDream's)
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(
            lambda: tiny.autoencoder_kl(cfg.latent_channels, scaling_factor=0.3611, shift_factor=0.1159),
            seed=cfg.seed + 1,
        ),
        "text_encoder": tiny.Part(lambda: clip_text(cfg.clip_l_dim), seed=cfg.seed + 2),
        "text_encoder_2": tiny.Part(lambda: clip_text(cfg.clip_g_dim), seed=cfg.seed + 3),
        "text_encoder_3": tiny.Part(lambda: tiny.t5_encoder(t5, cfg.text_dim), seed=cfg.seed + 4),
        "text_encoder_4": tiny.Part(lambda: tiny_llama(llama, cfg), seed=cfg.seed + 5),
        "tokenizer": tiny.Part(lambda: clip),
        "tokenizer_2": tiny.Part(lambda: clip),
        "tokenizer_3": tiny.Part(lambda: t5),
        "tokenizer_4": tiny.Part(lambda: llama),
        "scheduler": tiny.Part(lambda: scheduler(cfg.scheduler)),
    }


def comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_hidream` puts the ComfyUI single file by default."""
    return tiny.beside(folder, ".comfyui.safetensors")


def write_tiny_hidream(folder: Path, cfg: TinyHiDreamConfig | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny HiDream pipeline folder at ``folder`` and its transformer as ComfyUI holds it (under
    ``model.diffusion_model.``) at ``single_file`` (default :func:`comfy_path`). Returns ``folder``."""
    from diffpipe_hidream.original import diffusers_to_original

    folder = Path(folder)
    pipe = tiny.write_pipeline("HiDreamImagePipeline", parts(cfg or TinyHiDreamConfig()), folder)
    original = diffusers_to_original(pipe.transformer.state_dict(), pipe.transformer.config)
    tiny.save_single_file({PREFIX + k: v for k, v in original.items()}, Path(single_file or comfy_path(folder)))
    return folder


def tiny_config(path: Path, **keys: Any) -> Any:
    """The validated ``[model]`` table of the tiny HiDream at ``path`` in float32 (16 tokens per caption), plus
    ``keys``."""
    from diffpipe_core.schema import validate
    from diffpipe_hidream.config import HiDreamConfig

    table = {"type": "hidream", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    return validate(HiDreamConfig, {**table, **keys}, "test")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_hidream.testing FOLDER``: write a tiny HiDream (the folder and
    ``FOLDER.comfyui.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_hidream(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {comfy_path(folder)}")


if __name__ == "__main__":
    main()
