"""Write a tiny random-weight Anima to disk in its real layouts, for tests and benchmarks.

:func:`write_tiny_anima` saves an ``AnimaModularPipeline`` folder as ``ModularPipeline.save_pretrained`` writes it
(``modular_model_index.json``; ``transformer/`` a Predict2 ``CosmosTransformer3DModel``, ``text_conditioner/`` the
LLM adapter, ``vae/`` Qwen-Image's ``AutoencoderKLQwenImage``, ``text_encoder/`` a ``Qwen3Model``, ``tokenizer/``
and ``t5_tokenizer/`` trained in-process, ``scheduler/`` with Anima's shift 3) and beside it the transformer and
adapter as one file in ComfyUI's layout (:func:`comfy_path`: ``net.`` keys, the adapter under ``net.llm_adapter.``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.testing import tiny
from diffpipe_cosmos.testing import WORDS, TinyCosmosConfig, tiny_transformer


@dataclass
class TinyAnimaConfig(TinyCosmosConfig):
    """Sizes of the tiny Anima: Predict2's tiny transformer on 4 latent channels, cross-attending to the adapter's
    32-wide text; a 2-layer Qwen3 of width 32; a 2-block adapter padding to ``min_sequence_length`` tokens."""

    text_dim: int = 32
    adapter_layers: int = 2
    min_sequence_length: int = 16


def qwen3_encoder(tokenizer: Any, dim: int) -> Any:
    """A bare ``Qwen3Model`` (the pipeline's text encoder) of width ``dim``."""
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(tiny.decoder_config(Qwen3Config, tokenizer, dim, 2, head_dim=dim // 4))


def tiny_vae(channels: int) -> Any:
    """Qwen-Image's VAE (8x spatial) with non-trivial per-channel latent statistics."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1 * i - 0.15 for i in range(channels)], latents_std=[0.5 + 0.25 * i for i in range(channels)],
    )


def components(cfg: TinyAnimaConfig) -> dict[str, Any]:
    """The modular pipeline's components of ``cfg``, with fixed seeds."""
    from diffusers import AnimaTextConditioner, FlowMatchEulerDiscreteScheduler

    qwen_tok = tiny.qwen3_tokenizer()
    t5_tok = tiny.t5_tokenizer(WORDS, specials=("<pad>", "</s>", "<unk>"))
    d = cfg.text_dim
    return tiny.build_components({
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "text_conditioner": tiny.Part(lambda: AnimaTextConditioner(
            source_dim=d, target_dim=d, model_dim=d, num_layers=cfg.adapter_layers, num_attention_heads=2,
            target_vocab_size=len(t5_tok), min_sequence_length=cfg.min_sequence_length), seed=cfg.seed + 1),
        "vae": tiny.Part(lambda: tiny_vae(cfg.latent_channels), seed=cfg.seed + 2),
        "text_encoder": tiny.Part(lambda: qwen3_encoder(qwen_tok, d), seed=cfg.seed + 3),
        "tokenizer": tiny.Part(lambda: qwen_tok),
        "t5_tokenizer": tiny.Part(lambda: t5_tok),
        "scheduler": tiny.Part(lambda: FlowMatchEulerDiscreteScheduler(shift=3.0)),
    })


def comfy_path(folder: Path) -> Path:
    """Where :func:`write_tiny_anima` puts the ComfyUI-layout file of ``folder``'s transformer and adapter."""
    return tiny.beside(folder, "-comfy.safetensors")


def write_tiny_anima(folder: Path, cfg: TinyAnimaConfig | None = None) -> Path:
    """A tiny ``AnimaModularPipeline`` folder and its ComfyUI-layout single file beside it."""
    from diffusers.modular_pipelines import AnimaAutoBlocks

    from diffpipe_cosmos.anima_files import adapter_table, layout_for_config

    cfg = cfg or TinyAnimaConfig()
    folder = Path(folder)
    parts = components(cfg)
    pipe = AnimaAutoBlocks().init_pipeline()
    pipe.update_components(**parts)
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)
    state = layout_for_config(dict(parts["transformer"].config)).to_original(parts["transformer"].state_dict())
    state.update(adapter_table().to_original(parts["text_conditioner"].state_dict()))
    state["net.pos_embedder.seq"] = torch.arange(8, dtype=torch.float32)  # training-only, as released files hold
    tiny.save_single_file(state, comfy_path(folder))
    return folder


def load_pipeline(folder: Path) -> Any:
    """The ``AnimaModularPipeline`` of a tiny folder (float32), as ``ModularPipeline.from_pretrained`` loads it."""
    from diffusers import ModularPipeline

    from diffpipe_cosmos.resize import install

    install()  # the Cosmos transformer's one torchvision call, without torchvision
    pipe = ModularPipeline.from_pretrained(str(folder))
    pipe.load_components(dtype=torch.float32)
    return pipe


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_cosmos.testing_anima FOLDER``: write a tiny Anima (the folder and
    ``FOLDER-comfy.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_anima(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {comfy_path(folder)}")


if __name__ == "__main__":
    main()
