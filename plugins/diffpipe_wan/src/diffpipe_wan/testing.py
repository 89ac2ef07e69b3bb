"""Write a tiny random-weight Wan to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_wan` saves a complete diffusers folder (``model_index.json``, ``transformer/``, ``vae/``
(``AutoencoderKLWan`` with Wan's 8x spatial / 4x temporal geometry, or Wan 2.2's 16x one, and non-trivial
per-channel latent statistics), ``text_encoder/`` (UMT5), ``tokenizer/``, ``scheduler/``) as one of the Wan
variants (:class:`TinyWanConfig`): Wan 2.1 text-to-video (``WanPipeline``), Wan 2.1 image-to-video
(``WanImageToVideoPipeline`` with ``image_encoder/`` (CLIP vision) and ``image_processor/``), the two-expert Wan 2.2
A14B (``transformer_2/`` and ``boundary_ratio``) and Wan 2.2 TI2V (the 16x VAE). Beside the folder, each transformer
is written as one safetensors file in the original Wan key layout (``blocks.0.self_attn.q.weight``, ...), as ComfyUI
ships Wan. The tokenizer is trained in-process (no hub access).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from diffpipe_core.testing import tiny
from diffpipe_wan.original import layout_for_config
from diffpipe_wan.vace_original import layout_for_config as vace_layout_for_config

WORDS = (
    "a photo of cat dog red blue green house tree sky with on in the caption image clip video small large "
    "bright dark river mountain city car person walking running moving slowly camera pans 0 1 2 3 4 5 6 7 8 9"
).split()
T2V, I2V, VACE = "WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline"
VACE_LAYERS = (0, 2)  # of the tiny VACE's 3 blocks: block 1 adds no hint


@dataclass
class TinyWanConfig(tiny.TinySizes):
    """Sizes and variant of the tiny Wan (inner dim = heads x head dim).

    ``i2v``: a ``WanImageToVideoPipeline`` (transformer input: noisy latents, 4 mask channels, first-frame latents);
    ``clip``: with Wan 2.1's CLIP vision encoder and the transformer's image embedder; ``boundary_ratio``: two experts
    (Wan 2.2 A14B); ``vae22``: Wan 2.2's 16x VAE (TI2V 5B)."""

    attention_head_dim: int = 12
    ffn_dim: int = 32
    i2v: bool = False
    clip: bool = False
    boundary_ratio: float | None = None
    vae22: bool = False
    flf2v: bool = False  # Wan 2.1 FLF2V: the image embedder's pos_embed over a first and a last frame (with clip)
    vace: bool = False  # a WanVACEPipeline (WanVACETransformer3DModel, VACE_LAYERS of 3 blocks)
    fun: int = 0  # Wan Fun-Control: the channels after the noisy latents (2z: Wan 2.1's, 2z + 4: Wan 2.2's)
    shift: float = 5.0  # the scheduler's: Wan's 480p-class default

    @property
    def pipeline(self) -> str:
        return VACE if self.vace else I2V if self.i2v else T2V


def tokenizer():
    """A T5-like tokenizer (``words </s>``, pad id 0), up to 512 tokens (Wan's text length)."""
    return tiny.t5_tokenizer(WORDS, 512, specials=("<pad>", "</s>", "<unk>"))


def tiny_transformer(cfg: TinyWanConfig, seed: int | None = None):
    """The random-weight diffusers ``WanTransformer3DModel`` of ``cfg`` (``seed``: another expert's weights)."""
    from diffusers import WanTransformer3DModel, WanVACETransformer3DModel

    torch.manual_seed(cfg.seed if seed is None else seed)
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    z = cfg.latent_channels
    image = {"image_dim": 16, "added_kv_proj_dim": inner} if cfg.clip else {}
    if cfg.clip and cfg.flf2v:
        image["pos_embed_seq_len"] = 2 * 5  # two images of the tiny CLIP's 5 tokens
    if cfg.vace:  # the conditioning: inactive and reactive latents, the 8x8 mask pixels (vace_encoding.context)
        image = {"vace_layers": list(VACE_LAYERS), "vace_in_channels": 2 * z + 64}
    model_class = WanVACETransformer3DModel if cfg.vace else WanTransformer3DModel
    model = model_class(
        patch_size=(1, 2, 2),
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        in_channels=2 * z + 4 if cfg.i2v else z + cfg.fun,
        out_channels=z,
        text_dim=cfg.text_dim,
        freq_dim=16,
        ffn_dim=cfg.ffn_dim,
        num_layers=3 if cfg.vace else cfg.num_layers,
        rope_max_seq_len=64,
        **image,
    )
    if cfg.clip and cfg.flf2v:  # diffusers starts pos_embed at zeros: random, so the two images' order shows
        with torch.no_grad():
            model.condition_embedder.image_embedder.pos_embed.normal_()
    return model


def tiny_vae(cfg: TinyWanConfig):
    """A random ``AutoencoderKLWan`` with Wan 2.1's geometry (8x spatial, 4x temporal), or Wan 2.2's 16x one (2x2
    patchified input, residual blocks), and random per-channel ``latents_mean`` / ``latents_std``."""

    torch.manual_seed(cfg.seed + 1)
    z = cfg.latent_channels
    g = torch.Generator().manual_seed(cfg.seed + 1)
    stats = {
        "latents_mean": (torch.randn(z, generator=g) * 0.2).tolist(),
        "latents_std": (torch.rand(z, generator=g) + 0.5).tolist(),
    }
    extra = {"is_residual": True, "patch_size": 2, "in_channels": 12, "out_channels": 12, "scale_factor_spatial": 16}
    return tiny.wan_vae(z, **stats, **(extra if cfg.vae22 else {})).eval()


def image_encoder():
    """A tiny ``CLIPVisionModel`` (28x28 input, 14x14 patches: 5 tokens of width 16)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    return CLIPVisionModel(config)


def image_processor():
    """CLIP's image processor at the tiny encoder's 28 pixels."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})


def parts(cfg: TinyWanConfig) -> dict[str, tiny.Part]:
    """The pipeline components of ``cfg``, in build order."""
    tok = tokenizer()
    table = {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_vae(cfg)),
        "text_encoder": tiny.Part(lambda: tiny.t5_encoder(tok, cfg.text_dim, umt5=True), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=cfg.shift)),
    }
    if cfg.boundary_ratio is not None:
        table["transformer_2"] = tiny.Part(lambda: tiny_transformer(cfg, seed=cfg.seed + 10))
        table["boundary_ratio"] = tiny.Part(lambda: cfg.boundary_ratio)
    if cfg.clip:
        table["image_encoder"] = tiny.Part(image_encoder, seed=cfg.seed + 3)
        table["image_processor"] = tiny.Part(image_processor)
    if cfg.vae22:
        table["expand_timesteps"] = tiny.Part(lambda: True)
    return table


def single_file_path(folder: Path, component: str = "transformer") -> Path:
    """Where :func:`write_tiny_wan` puts a transformer's original-layout single file."""
    return tiny.beside(folder, f"{'' if component == 'transformer' else '_2'}.wan.safetensors")


def write_tiny_wan(folder: Path, cfg: TinyWanConfig | None = None) -> Path:
    """Save a tiny Wan pipeline folder at ``folder`` and each transformer in the original Wan layout at
    :func:`single_file_path` (``<folder>.wan.safetensors``, ``<folder>_2.wan.safetensors`` for the second expert)."""
    cfg = cfg or TinyWanConfig()
    folder = Path(folder)
    pipe = tiny.write_pipeline(cfg.pipeline, parts(cfg), folder)
    for component in ("transformer", "transformer_2"):
        model = getattr(pipe, component, None)
        if model is not None:
            table = (vace_layout_for_config if cfg.vace else layout_for_config)(model.config)
            original = table.to_original(model.state_dict())
            tiny.save_single_file(original, single_file_path(folder, component))
    return folder


CLIP_CAPTIONS = ("a red car moving slowly", "a river in a city", "camera pans over a mountain", "a dog running")


def write_clips(folder: Path, captions: list[str] | tuple[str, ...], frames: int, size: tuple[int, int]) -> list[Path]:
    """``clip_000.mp4``, ... at 16 fps (the model's rate), ``size`` = (width, height), each with its caption file."""
    from diffpipe_core.testing.media import write_clip_dataset

    return write_clip_dataset(folder, frames, captions, size, fps=16, drifting=True)


def write_tiny_wan_i2v(folder: Path) -> Path:
    """The tiny Wan 2.1 image-to-video folder (``wan-i2v``: ``WanImageToVideoPipeline`` with its CLIP image encoder)."""
    return write_tiny_wan(folder, TinyWanConfig(i2v=True, clip=True))


def write_tiny_wan_flf2v(folder: Path) -> Path:
    """The tiny Wan 2.1 first-last-frame-to-video folder (``wan-flf2v``: CLIP vision, the two-image ``pos_embed``)."""
    return write_tiny_wan(folder, TinyWanConfig(i2v=True, clip=True, flf2v=True))


def write_tiny_wan_ti2v(folder: Path) -> Path:
    """The tiny Wan 2.2 TI2V folder (``wan-ti2v``: the 16x VAE, ``expand_timesteps``)."""
    return write_tiny_wan(folder, TinyWanConfig(vae22=True))


def write_tiny_wan_vace(folder: Path) -> Path:
    """The tiny Wan VACE folder (``wan-vace``: ``WanVACEPipeline``, VACE blocks at :data:`VACE_LAYERS`)."""
    return write_tiny_wan(folder, TinyWanConfig(vace=True))


def write_tiny_wan_fun(folder: Path) -> Path:
    """The tiny Wan 2.1 Fun-Control folder (``wan-fun``: a ``WanPipeline`` whose transformer takes 3z channels)."""
    return write_tiny_wan(folder, TinyWanConfig(fun=2 * TinyWanConfig().latent_channels))


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_wan.testing FOLDER [--i2v] [--clips DIR]``: write a tiny Wan (folder +
    ``FOLDER.wan.safetensors``) and, with ``--clips``, four short captioned mp4 clips for a demo dataset."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--i2v", action="store_true", help="a Wan 2.1 image-to-video folder (with CLIP vision)")
    parser.add_argument("--clips", type=Path, help="also write 4 captioned 1 s mp4 clips (16 fps, 64x48) here")
    args = parser.parse_args(argv)
    folder = write_tiny_wan(args.folder, TinyWanConfig(i2v=args.i2v, clip=args.i2v))
    print(f"wrote {folder} and {single_file_path(folder)}")
    tiny.demo_clips(args.clips, lambda d: write_clips(d, CLIP_CAPTIONS, frames=17, size=(64, 48)), len(CLIP_CAPTIONS))


if __name__ == "__main__":
    main()
