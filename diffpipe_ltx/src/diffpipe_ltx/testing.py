"""Write a tiny random-weight LTX-Video to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_ltx` saves a complete diffusers ``LTXPipeline`` folder (``model_index.json``,
``transformer/``, ``vae/``, ``text_encoder/`` (T5), ``tokenizer/``, ``scheduler/``) and, beside it, the
same transformer as one safetensors file in the original Lightricks key layout
(``model.diffusion_model.patchify_proj.weight``, ``...adaln_single...``, ``...attn1.q_norm.weight``), as
LTX-Video checkpoints are downloaded. The VAE has the real compression (32x spatial, 8x temporal) and
non-trivial per-channel latent statistics; the tokenizer is trained in-process (no hub access).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from diffpipe_core.testing import tiny
from diffpipe_ltx.lightricks import layout_for_config

WORDS = (
    "a photo of cat dog red blue green house tree sky with on in the caption image clip video small large "
    "bright dark river mountain city car person walking running moving slowly camera pans 0 1 2 3 4 5 6 7 8 9"
).split()


@dataclass
class TinyLTXConfig(tiny.TinySizes):
    """Sizes of the tiny LTX-Video (inner dim = heads x head dim = the T5 width)."""

    latent_channels: int = 8
    vae_channels: int = 8
    scaling_factor: float = 1.25  # the real VAE uses 1.0; != 1 here so tests see where it is applied


def _tokenizer(max_length: int):
    """A T5-like tokenizer (``words </s>``, pad id 0) trained in-process; loads back with AutoTokenizer."""
    return tiny.t5_tokenizer(WORDS, max_length, specials=("<pad>", "</s>", "<unk>"))


def tiny_transformer(cfg: TinyLTXConfig):
    """The random-weight diffusers ``LTXVideoTransformer3DModel`` of ``cfg``."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(cfg.seed)
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    return LTXVideoTransformer3DModel(
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        cross_attention_dim=inner,
        num_layers=cfg.num_layers,
        qk_norm="rms_norm_across_heads",
        caption_channels=cfg.text_dim,
    )


def tiny_vae(cfg: TinyLTXConfig):
    """A random ``AutoencoderKLLTXVideo`` with LTX's geometry (patch 4 x 3 scalings: 32x spatial, 8x temporal)
    and random per-channel ``latents_mean`` / ``latents_std``."""
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(cfg.seed + 1)
    ch = (cfg.vae_channels,) * 4
    vae = AutoencoderKLLTXVideo(
        latent_channels=cfg.latent_channels,
        block_out_channels=ch,
        decoder_block_out_channels=ch,
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4,
        upsample_factor=(1,) * 4,
        patch_size=4,
        patch_size_t=1,
        scaling_factor=cfg.scaling_factor,
    )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn(cfg.latent_channels) * 0.1)
        vae.latents_std.copy_(torch.rand(cfg.latent_channels) * 0.5 + 0.5)
    return vae.eval()


def parts(cfg: TinyLTXConfig) -> dict[str, tiny.Part]:
    """The ``LTXPipeline`` components of ``cfg``, in build order."""
    tokenizer = _tokenizer(128)
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_vae(cfg)),
        "text_encoder": tiny.Part(lambda: tiny.t5_encoder(tokenizer, cfg.text_dim), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tokenizer),
        # LTX-Video's own scheduler settings (scheduler/scheduler_config.json of Lightricks/LTX-Video)
        "scheduler": tiny.Part(
            lambda: tiny.flow_scheduler(
                use_dynamic_shifting=True,
                base_image_seq_len=1024,
                max_image_seq_len=4096,
                base_shift=0.95,
                max_shift=2.05,
                shift_terminal=0.1,
            )
        ),
    }


def tiny_pipeline(cfg: TinyLTXConfig):
    """A complete random-weight ``LTXPipeline`` (not yet on disk)."""
    return tiny.pipeline("LTXPipeline", parts(cfg))


def single_file_path(folder: Path) -> Path:
    """Where :func:`write_tiny_ltx` puts the original-layout single file by default."""
    return tiny.beside(folder, ".ltxv.safetensors")


def write_tiny_ltx(folder: Path, cfg: TinyLTXConfig | None = None, single_file: Path | None = None) -> Path:
    """Save a tiny LTX-Video pipeline folder at ``folder`` and its transformer in the original Lightricks layout
    (keys under ``model.diffusion_model.``) at ``single_file`` (default ``<folder>.ltxv.safetensors``)."""
    folder = Path(folder)
    pipe = tiny.write_pipeline("LTXPipeline", parts(cfg or TinyLTXConfig()), folder)
    original = layout_for_config(pipe.transformer.config).to_original(pipe.transformer.state_dict())
    tiny.save_single_file(original, Path(single_file or single_file_path(folder)))
    return folder


def write_clips(folder: Path, captions: list[str] | tuple[str, ...], frames: int, size: tuple[int, int]) -> list[Path]:
    """``clip_000.mp4``, ... at 25 fps (the model's rate), ``size`` = (width, height), each with its caption file."""
    from diffpipe_core.testing.media import write_clip_dataset

    return write_clip_dataset(folder, frames, captions, size, fps=25)


CLIP_CAPTIONS = ("a red car moving slowly", "a river in a city", "camera pans over a mountain", "a dog running")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_ltx.testing FOLDER [--clips DIR]``: write a tiny LTX-Video (folder +
    ``FOLDER.ltxv.safetensors``) and, with ``--clips``, four short captioned mp4 clips for a demo dataset."""
    clips = lambda d: write_clips(d, CLIP_CAPTIONS, frames=25, size=(96, 64))  # noqa: E731
    what = "4 captioned 1 s mp4 clips (25 fps, 96x64)"
    tiny.video_demo_main(argv, main.__doc__, write_tiny_ltx, single_file_path, (what, clips, len(CLIP_CAPTIONS)))


if __name__ == "__main__":
    main()
