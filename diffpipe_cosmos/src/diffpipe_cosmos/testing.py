"""Write tiny random-weight Cosmos models to disk in their real layouts, for tests, demos and benchmarks.

:func:`write_tiny_cosmos` saves a diffusers folder (``model_index.json``, ``transformer/``, ``vae/``,
``text_encoder/`` (T5), ``tokenizer/``, ``scheduler/``) for Cosmos-1.0 text-to-world
(``CosmosTextToWorldPipeline``: ``AutoencoderKLCosmos``, ``EDMEulerScheduler``) or Cosmos-Predict2
(``Cosmos2TextToImagePipeline``: ``AutoencoderKLWan``, ``FlowMatchEulerDiscreteScheduler``), with ``video2world``
the video-to-world transformer (one more input channel: the condition mask) and pipeline class
(``CosmosVideoToWorldPipeline``, ``Cosmos2VideoToWorldPipeline``), and, beside it,
the same transformer as one safetensors file in NVIDIA's original key layout (``net.blocks...``, with the
training-only tensors original checkpoints carry). The tokenizer is trained in-process (no hub access).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.parts.layout import count_blocks
from diffpipe_core.testing import tiny
from diffpipe_cosmos.nvidia import Variant, layout

WORDS = (
    "a photo of cat dog red blue green house tree sky with on in the caption image video small large "
    "bright dark river mountain city car person walking driving robot arm 0 1 2 3 4 5 6 7 8 9"
).split()
PIPELINES = {"1.0": "CosmosTextToWorldPipeline", "predict2": "Cosmos2TextToImagePipeline"}
VIDEO_PIPELINES = {"1.0": "CosmosVideoToWorldPipeline", "predict2": "Cosmos2VideoToWorldPipeline"}
LIBRARIES = {"text_encoder": "transformers", "tokenizer": "transformers"}


@dataclass
class TinyCosmosConfig(tiny.TinySizes):
    """Sizes of the tiny Cosmos transformer, VAE and T5."""

    variant: Variant = "predict2"
    attention_head_dim: int = 12
    text_dim: int = 16
    mlp_ratio: float = 2.0
    video2world: bool = False  # the video-to-world transformer (in_channels + 1: the condition mask) and pipeline


def tiny_transformer(cfg: TinyCosmosConfig):
    """The random-weight diffusers ``CosmosTransformer3DModel`` of ``cfg`` (1.0: learnable extra position
    embedding and temporal RoPE scale 2; Predict2: RoPE only, spatial scale 4, as the released configs)."""
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(cfg.seed)
    v1 = cfg.variant == "1.0"
    sizes = {name: getattr(cfg, name) for name in ("num_attention_heads", "attention_head_dim", "num_layers")}
    model = CosmosTransformer3DModel(
        **sizes,
        in_channels=cfg.latent_channels + int(cfg.video2world),
        out_channels=cfg.latent_channels,
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
    from diffusers import AutoencoderKLCosmos

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
        )
    return tiny.wan_vae(
        c, latents_mean=[0.1 * i - 0.15 for i in range(c)], latents_std=[0.5 + 0.25 * i for i in range(c)]
    )


def _scheduler(variant: Variant):
    from diffusers import EDMEulerScheduler, FlowMatchEulerDiscreteScheduler

    if variant == "1.0":
        return EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=0.5, final_sigmas_type="sigma_min")
    return FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True, shift=1.0)


def parts(cfg: TinyCosmosConfig) -> dict[str, tiny.Part]:
    """The pipeline's components of ``cfg``, with their seeds."""
    tok = tiny.t5_tokenizer(WORDS, specials=("<pad>", "</s>", "<unk>"))
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_vae(cfg), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: tiny.t5_encoder(tok, cfg.text_dim, heads=2), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: _scheduler(cfg.variant)),
    }


def to_nvidia(state: dict[str, torch.Tensor], variant: Variant) -> dict[str, torch.Tensor]:
    """A diffusers ``CosmosTransformer3DModel`` state dict in NVIDIA's layout (``net.`` keys)."""
    return layout(variant, count_blocks(state, r"transformer_blocks\.(\d+)\.")).to_original(state)


def to_diffusers(state: dict[str, torch.Tensor], variant: Variant) -> dict[str, torch.Tensor]:
    """An NVIDIA-layout state dict in diffusers keys (training-only tensors dropped)."""
    pattern = r"(?:net\.)?blocks\.block(\d+)\." if variant == "1.0" else r"(?:net\.)?blocks\.(\d+)\."
    return layout(variant, count_blocks(state, pattern)).to_model(state)


def original_path(folder: Path) -> Path:
    """Where :func:`write_tiny_cosmos` puts the original-layout single file by default."""
    return tiny.beside(folder, ".original.safetensors")


def write_tiny_cosmos(folder: Path, cfg: TinyCosmosConfig | None = None, original_file: Path | None = None) -> Path:
    """Save a tiny Cosmos diffusers folder at ``folder`` and its transformer in NVIDIA's layout at
    ``original_file`` (default ``<folder>.original.safetensors``). Returns ``folder``.

    The pipeline classes refuse to be built without NVIDIA's guardrail package, so the components are saved one
    by one, with the ``model_index.json`` ``save_pretrained`` would write."""
    cfg = cfg or TinyCosmosConfig()
    folder = Path(folder)
    components = tiny.build_components(parts(cfg))
    pipeline = (VIDEO_PIPELINES if cfg.video2world else PIPELINES)[cfg.variant]
    index: dict[str, Any] = {"_class_name": pipeline, "_diffusers_version": "0.42.1"}
    index["safety_checker"] = [None, None]
    for name, part in components.items():
        kw = {} if name in ("tokenizer", "scheduler") else {"safe_serialization": True}
        part.save_pretrained(str(folder / name), **kw)
        index[name] = [LIBRARIES.get(name, "diffusers"), type(part).__name__]
    index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))

    original = to_nvidia({k: v.contiguous() for k, v in components["transformer"].state_dict().items()}, cfg.variant)
    # training-only tensors that NVIDIA's checkpoints carry and loading must skip
    original["net.pos_embedder.seq"] = torch.arange(8, dtype=torch.float32)
    original["net.logvar.1.weight"] = torch.zeros(1, 128)
    if cfg.variant == "predict2":
        original["net.accum_video_sample_counter"] = torch.zeros(())
    tiny.save_single_file(original, Path(original_file) if original_file else original_path(folder))
    return folder


def write_tiny_cosmos1(folder: Path) -> Path:
    """The tiny Cosmos 1.0 text-to-world folder (``cosmos``)."""
    return write_tiny_cosmos(folder, TinyCosmosConfig(variant="1.0"))


def write_tiny_predict2(folder: Path) -> Path:
    """The tiny Cosmos-Predict2 text-to-image folder (``cosmos-predict2``)."""
    return write_tiny_cosmos(folder, TinyCosmosConfig(variant="predict2"))


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_cosmos.testing FOLDER [--variant 1.0|predict2] [--video2world]``: write a tiny Cosmos
    (folder + ``FOLDER.original.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    parser.add_argument("--variant", choices=["1.0", "predict2"], default="predict2")
    parser.add_argument("--video2world", action="store_true", help="the video-to-world transformer and pipeline")
    args = parser.parse_args(argv)
    folder = write_tiny_cosmos(args.folder, TinyCosmosConfig(variant=args.variant, video2world=args.video2world))
    print(f"wrote {folder} and {original_path(folder)}")


if __name__ == "__main__":
    main()
