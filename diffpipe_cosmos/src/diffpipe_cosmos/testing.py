"""Write tiny random-weight Cosmos models to disk in their real layouts, for tests, demos and benchmarks.

:func:`write_tiny_cosmos` saves a diffusers folder (``model_index.json``, ``transformer/``, ``vae/``,
``text_encoder/`` (T5), ``tokenizer/``, ``scheduler/``) for Cosmos-1.0 text-to-world
(``CosmosTextToWorldPipeline``: ``AutoencoderKLCosmos``, ``EDMEulerScheduler``) or Cosmos-Predict2
(``Cosmos2TextToImagePipeline``: ``AutoencoderKLWan``, ``FlowMatchEulerDiscreteScheduler``) and, beside it,
the same transformer as one safetensors file in NVIDIA's original key layout (``net.blocks...``, with the
training-only tensors original checkpoints carry). The tokenizer is trained in-process (no hub access).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffpipe_cosmos.original import Variant, diffusers_to_original

WORDS = (
    "a photo of cat dog red blue green house tree sky with on in the caption image video small large "
    "bright dark river mountain city car person walking driving robot arm 0 1 2 3 4 5 6 7 8 9"
).split()
PIPELINES = {"1.0": "CosmosTextToWorldPipeline", "predict2": "Cosmos2TextToImagePipeline"}


@dataclass
class TinyCosmosConfig:
    """Sizes of the tiny Cosmos transformer, VAE and T5."""

    variant: Variant = "predict2"
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 12
    latent_channels: int = 4
    text_dim: int = 16
    mlp_ratio: float = 2.0
    seed: int = 0


def _tokenizer(max_length: int = 512):
    """A T5-like tokenizer (``words </s>``, pad id 0) trained in-process; loads back with AutoTokenizer."""
    from diffpipe_core.testing.tokenizers import word_level_tokenizer

    specials = ["<pad>", "</s>", "<unk>"]
    return word_level_tokenizer(WORDS, specials, "$A </s>", max_length, pad_token="<pad>", eos_token="</s>")


def tiny_transformer(cfg: TinyCosmosConfig):
    """The random-weight diffusers ``CosmosTransformer3DModel`` of ``cfg`` (1.0: learnable extra position
    embedding and temporal RoPE scale 2; Predict2: RoPE only, spatial scale 4, as the released configs)."""
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(cfg.seed)
    v1 = cfg.variant == "1.0"
    model = CosmosTransformer3DModel(
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        num_layers=cfg.num_layers,
        mlp_ratio=cfg.mlp_ratio,
        text_embed_dim=cfg.text_dim,
        adaln_lora_dim=4,
        max_size=(8, 32, 32),
        patch_size=(1, 2, 2),
        rope_scale=(2.0, 1.0, 1.0) if v1 else (1.0, 4.0, 4.0),
        concat_padding_mask=True,
        extra_pos_embed_type="learnable" if v1 else None,
    )
    if v1:  # zero-initialised in diffusers; random here so that loading them is tested
        with torch.no_grad():
            for p in model.learnable_pos_embed.parameters():
                p.normal_()
    return model.eval()


def tiny_vae(cfg: TinyCosmosConfig):
    """1.0: ``AutoencoderKLCosmos`` (8x spatial, 8x temporal, per-channel-and-frame latent statistics for up to
    4 latent frames); Predict2: ``AutoencoderKLWan`` (8x spatial, 4x temporal, per-channel statistics)."""
    from diffusers import AutoencoderKLCosmos, AutoencoderKLWan

    torch.manual_seed(cfg.seed + 1)
    c = cfg.latent_channels
    if cfg.variant == "1.0":
        return AutoencoderKLCosmos(
            latent_channels=c,
            encoder_block_out_channels=(8, 8, 8, 8),
            decode_block_out_channels=(8, 8, 8, 8),
            attention_resolutions=(),
            resolution=64,
            num_layers=1,
            patch_size=4,
            spatial_compression_ratio=8,
            temporal_compression_ratio=8,
            latents_mean=[0.05 * (i % 7) - 0.1 for i in range(4 * c)],
            latents_std=[0.5 + 0.1 * (i % 5) for i in range(4 * c)],
        ).eval()
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=c,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1 * i - 0.15 for i in range(c)],
        latents_std=[0.5 + 0.25 * i for i in range(c)],
    ).eval()


def tiny_text_encoder(cfg: TinyCosmosConfig, vocab: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(cfg.seed + 2)
    return T5EncoderModel(
        T5Config(
            vocab_size=vocab,
            d_model=cfg.text_dim,
            d_kv=8,
            d_ff=2 * cfg.text_dim,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).eval()


def _scheduler(variant: Variant):
    from diffusers import EDMEulerScheduler, FlowMatchEulerDiscreteScheduler

    if variant == "1.0":
        return EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=0.5, final_sigmas_type="sigma_min")
    return FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True, shift=1.0)


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_cosmos` puts the original-layout single file by default."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".original.safetensors")


def write_tiny_cosmos(folder: Path, cfg: TinyCosmosConfig | None = None, original_file: Path | None = None) -> Path:
    """Save a tiny Cosmos diffusers folder at ``folder`` and its transformer in NVIDIA's layout at
    ``original_file`` (default ``<folder>.original.safetensors``). Returns ``folder``."""
    cfg = cfg or TinyCosmosConfig()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    transformer = tiny_transformer(cfg)
    parts = {
        "transformer": transformer,
        "vae": tiny_vae(cfg),
        "text_encoder": tiny_text_encoder(cfg, len(tokenizer)),
        "tokenizer": tokenizer,
        "scheduler": _scheduler(cfg.variant),
    }
    for name, part in parts.items():
        kw = {} if name in ("tokenizer", "scheduler") else {"safe_serialization": True}
        part.save_pretrained(str(folder / name), **kw)
    libraries = {"text_encoder": "transformers", "tokenizer": "transformers"}
    index = {"_class_name": PIPELINES[cfg.variant], "_diffusers_version": "0.42.1", "safety_checker": [None, None]}
    index.update({name: [libraries.get(name, "diffusers"), type(part).__name__] for name, part in parts.items()})
    index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))

    state = {k: v.contiguous() for k, v in transformer.state_dict().items()}
    original = diffusers_to_original(state, cfg.variant)
    # training-only tensors that NVIDIA's checkpoints carry and loading must skip
    original["net.pos_embedder.seq"] = torch.arange(8, dtype=torch.float32)
    original["net.logvar.1.weight"] = torch.zeros(1, 128)
    if cfg.variant == "predict2":
        original["net.accum_video_sample_counter"] = torch.zeros(())
    save_file(original, str(original_file or original_path(folder)), metadata={"format": "pt"})
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_cosmos.testing FOLDER [--variant 1.0|predict2]``: write a tiny Cosmos
    (folder + ``FOLDER.original.safetensors``)."""
    from diffpipe_core.quiet import quiet_script

    quiet_script()  # the libraries' chatter stays behind DIFFPIPE_VERBOSE=1, as in the CLI
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--variant", choices=["1.0", "predict2"], default="predict2")
    args = parser.parse_args(argv)
    folder = write_tiny_cosmos(args.folder, TinyCosmosConfig(variant=args.variant))
    print(f"wrote {folder} and {original_path(folder)}")


if __name__ == "__main__":
    main()
