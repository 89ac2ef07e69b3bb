"""Write a tiny random-weight Flux to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_flux` saves a complete diffusers ``FluxPipeline`` folder (``model_index.json``,
``transformer/``, ``vae/``, ``text_encoder/`` (CLIP-L-like), ``text_encoder_2/`` (T5), ``tokenizer/``,
``tokenizer_2/``, ``scheduler/``) and, beside it, the same transformer as one safetensors file in the
original BFL key layout (``double_blocks.0.img_attn.qkv.weight``, ...), as Flux checkpoints are
downloaded. Tokenizers are trained in-process (no hub access).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffpipe_flux.bfl import diffusers_to_bfl

WORDS = (
    "a photo of cat dog red blue green house tree sky with on in the caption image small large "
    "bright dark river mountain city car person painting style 0 1 2 3 4 5 6 7 8 9"
).split()


@dataclass
class TinyFluxConfig:
    """Sizes of the tiny Flux. ``guidance_embeds=True`` is dev-like, False schnell-like."""

    num_layers: int = 2
    num_single_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 4, 8)
    latent_channels: int = 4
    guidance_embeds: bool = True
    text_dim: int = 32  # T5 d_model = joint_attention_dim
    clip_dim: int = 32  # CLIP hidden = pooled_projection_dim
    vae_channels: tuple[int, ...] = field(default=(8, 8, 8, 8))  # 4 levels: factor 8, like Flux's VAE
    seed: int = 0


def _tokenizer(template: str, max_length: int):
    """A CLIP-like (``"<s> $A </s>"``) or T5-like (``"$A </s>"``) word-level tokenizer over WORDS."""
    from diffpipe_core.testing.tokenizers import word_level_tokenizer

    specials = ["<pad>", "</s>", "<unk>", "<s>"]
    return word_level_tokenizer(
        WORDS, specials, template, max_length, pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )


def tiny_transformer(cfg: TinyFluxConfig):
    """The random-weight diffusers ``FluxTransformer2DModel`` of ``cfg`` (2x2 packed latents in)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(cfg.seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * cfg.latent_channels,
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.text_dim,
        pooled_projection_dim=cfg.clip_dim,
        guidance_embeds=cfg.guidance_embeds,
        axes_dims_rope=list(cfg.axes_dims_rope),
    )


def tiny_pipeline(cfg: TinyFluxConfig):
    """A complete random-weight ``FluxPipeline`` (not yet on disk)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    transformer = tiny_transformer(cfg)
    torch.manual_seed(cfg.seed + 1)
    n = len(cfg.vae_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=cfg.vae_channels,
        layers_per_block=1,
        latent_channels=cfg.latent_channels,
        norm_num_groups=min(cfg.vae_channels),
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    clip_tok, t5_tok = _tokenizer("<s> $A </s>", 77), _tokenizer("$A </s>", 512)
    vocab = len(clip_tok)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab,
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
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=vocab,
            d_model=cfg.text_dim,
            d_kv=8,
            d_ff=2 * cfg.text_dim,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=t5_tok.pad_token_id,
        )
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae.eval(),
        text_encoder=clip.eval(),
        tokenizer=clip_tok,
        text_encoder_2=t5.eval(),
        tokenizer_2=t5_tok,
        transformer=transformer.eval(),
    )


def write_tiny_flux(folder: Path, cfg: TinyFluxConfig | None = None, bfl_file: Path | None = None) -> Path:
    """Save a tiny Flux pipeline folder at ``folder`` and its transformer as a BFL single file at
    ``bfl_file`` (default ``<folder>.bfl.safetensors``, beside the folder). Returns ``folder``."""
    cfg = cfg or TinyFluxConfig()
    folder = Path(folder)
    pipe = tiny_pipeline(cfg)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    bfl_file = Path(bfl_file) if bfl_file else bfl_path(folder)
    state = {k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}
    save_file(diffusers_to_bfl(state), str(bfl_file), metadata={"format": "pt"})
    return folder


def bfl_path(folder: Path) -> Path:
    """Where :func:`write_tiny_flux` puts the BFL single file by default."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".bfl.safetensors")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_flux.testing FOLDER``: write a tiny Flux (folder + ``FOLDER.bfl.safetensors``)."""
    from diffpipe_core.quiet import quiet_script

    quiet_script()  # the libraries' chatter stays behind DIFFPIPE_VERBOSE=1, as in the CLI
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--schnell", action="store_true", help="no guidance embedding (schnell-like)")
    args = parser.parse_args(argv)
    folder = write_tiny_flux(args.folder, TinyFluxConfig(guidance_embeds=not args.schnell))
    print(f"wrote {folder} and {bfl_path(folder)}")


if __name__ == "__main__":
    main()
