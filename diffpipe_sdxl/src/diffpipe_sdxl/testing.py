"""A tiny random-weight SDXL written to disk in the real layouts, for tests and demos (no network).

``write_tiny_sdxl(folder)`` saves a complete diffusers ``StableDiffusionXLPipeline`` folder (unet, vae,
text_encoder, text_encoder_2, CLIP tokenizers, scheduler, model_index.json);
``write_single_file(folder, file)`` writes the same weights as one original-layout (SGM/ComfyUI)
``.safetensors`` checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffpipe_core.testing import tiny

TINY_UNET = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    sample_size=32,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    projection_class_embeddings_input_dim=80,  # pooled (32) + 6 time ids x 8
    cross_attention_dim=64,  # text_encoder (24) + text_encoder_2 (40)
    norm_num_groups=1,
)
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 8, 16, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=64,
    scaling_factor=0.13025,
    force_upcast=True,
)
WORDS = "a cat dog photo of the on in red blue green tree house sky sea and with painting portrait".split()


def tiny_clip_tokenizer(pad_token: str) -> object:
    """A real ``CLIPTokenizer`` (byte-level BPE with ``</w>`` word ends) over a tiny vocabulary."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    merges: list[tuple[str, str]] = []
    for word in WORDS:  # merge each word left to right into one token
        piece = word[0]
        for k, ch in enumerate(word[1:], start=1):
            nxt = ch + ("</w>" if k == len(word) - 1 else "")
            if piece + nxt not in vocab:
                merges.append((piece, nxt))
                vocab[piece + nxt] = len(vocab)
            piece = piece + nxt
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=77)


def parts(seed: int = 0) -> dict[str, tiny.Part]:
    """The ``StableDiffusionXLPipeline`` components, in build order (one random stream from ``seed``)."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tok1, tok2 = tiny_clip_tokenizer("<|endoftext|>"), tiny_clip_tokenizer("!")
    common = dict(
        vocab_size=len(tok1),
        max_position_embeddings=77,
        num_hidden_layers=2,
        num_attention_heads=2,
        bos_token_id=tok1.bos_token_id,
        eos_token_id=tok1.eos_token_id,
        pad_token_id=1,
    )
    te1 = CLIPTextConfig(hidden_size=24, intermediate_size=48, hidden_act="quick_gelu", **common)
    te2 = CLIPTextConfig(hidden_size=40, intermediate_size=80, hidden_act="gelu", projection_dim=32, **common)
    return {
        "text_encoder": tiny.Part(lambda: CLIPTextModel(te1), seed=seed),
        "text_encoder_2": tiny.Part(lambda: CLIPTextModelWithProjection(te2)),
        "vae": tiny.Part(lambda: AutoencoderKL(**TINY_VAE)),
        "unet": tiny.Part(lambda: UNet2DConditionModel(**TINY_UNET)),
        "tokenizer": tiny.Part(lambda: tok1),
        "tokenizer_2": tiny.Part(lambda: tok2),
        "scheduler": tiny.Part(
            lambda: EulerDiscreteScheduler(
                beta_start=0.00085,
                beta_end=0.012,
                beta_schedule="scaled_linear",
                num_train_timesteps=1000,
                steps_offset=1,
                timestep_spacing="leading",
            )
        ),
    }


def write_tiny_sdxl(folder: Path | str, seed: int = 0) -> Path:
    """Write a random-weight tiny SDXL as a diffusers pipeline folder and return it."""
    tiny.write_pipeline("StableDiffusionXLPipeline", parts(seed), Path(folder))
    return Path(folder)


def sgm_state(pipe: Any) -> dict[str, torch.Tensor]:
    """A ``StableDiffusionXLPipeline``'s UNet, VAE and text encoders as one SGM-layout state dict."""
    from diffpipe_sdxl import sgm

    tables = {"unet": sgm.unet_table(pipe.unet.config)}
    configs = {"vae": pipe.vae.config, "text_encoder_2": pipe.text_encoder_2.config.to_dict()}
    tables.update(sgm.component_tables(configs.get))
    state: dict[str, torch.Tensor] = {}
    for name, table in tables.items():
        state.update(table.to_original(getattr(pipe, name).state_dict()))
    return state


def write_single_file(folder: Path | str, file: Path | str) -> Path:
    """Write the weights of the diffusers folder ``folder`` as one original-layout SDXL checkpoint ``file``."""
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(str(folder), local_files_only=True)
    return tiny.save_single_file(sgm_state(pipe), Path(file))
