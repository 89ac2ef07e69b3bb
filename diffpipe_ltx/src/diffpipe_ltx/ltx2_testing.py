"""Write a tiny random-weight LTX-2 to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_ltx2` saves a complete diffusers ``LTX2Pipeline`` folder (``transformer/``, ``vae/``,
``audio_vae/``, ``vocoder/``, ``text_encoder/`` (a Gemma 3 ``Gemma3ForConditionalGeneration`` with its vision tower),
``tokenizer/``, ``connectors/``, ``scheduler/``) and, beside it, the same transformer as one safetensors file in the
original Lightricks key layout (``model.diffusion_model.patchify_proj.weight``, ``...audio_adaln_single...``,
``...av_ca_a2v_gate_adaln_single...``), as LTX-2 checkpoints are downloaded. The VAE has LTX-2's geometry (patch 4,
``spatial, temporal, spatiotemporal, spatiotemporal`` downsampling: 32x spatial, 8x temporal) and non-trivial
per-channel latent statistics; the connectors have learnable registers, as LTX-2's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from diffpipe_core.testing import tiny
from diffpipe_ltx.ltx2_original import layout_for_config
from diffpipe_ltx.testing import CLIP_CAPTIONS

FRAME_RATE = 24  # LTX2Pipeline's default frame_rate


@dataclass
class TinyLTX2Config(tiny.TinySizes):
    """Sizes of the tiny LTX-2 (video inner dim = heads x head dim; the audio stream is half as wide)."""

    latent_channels: int = 4
    audio_latent_channels: int = 2
    mel_bins: int = 8
    text_dim: int = 16  # Gemma's hidden size = the transformer's caption_channels
    text_layers: int = 2
    registers: int = 8  # connector registers; max_sequence_length must be a multiple
    vae_channels: int = 8
    #: LTX-2.3's switches: text cross-attention modulation (9-row tables, prompt tables), gated attention, no caption
    #: projection (the connectors project per stream); ``prompt_adaln`` False is LTX-2.5's static prompt tables
    ltx23: bool = False
    prompt_adaln: bool = True
    gemma4: bool = False  #: LTX-2.5's text encoder generation (Gemma 4) in place of Gemma 3


def tokenizer(max_length: int = 1024):
    """A Gemma-like byte-level BPE tokenizer (``<bos>`` first, ``<pad>`` padding) trained in-process."""
    texts = [" ".join(tiny.WORDS) + " clip video moving slowly camera pans robot dancing"]
    return tiny.bpe_tokenizer(
        texts, ["<pad>", "<eos>", "<bos>", "<image_soft_token>"], "<bos> $A", max_length,
        pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
    )


def gemma3(tok, cfg: TinyLTX2Config):
    """A random ``Gemma3ForConditionalGeneration`` (the class LTX-2's text encoder is), vision tower included."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=cfg.text_dim, intermediate_size=2 * cfg.text_dim,
        num_hidden_layers=cfg.text_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=1024, sliding_window=16, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"))
    return Gemma3ForConditionalGeneration(config)


def gemma4(tok, cfg: TinyLTX2Config):
    """A random ``Gemma4ForConditionalGeneration`` (LTX-2.5's text encoder generation), its language model alone."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    text = Gemma4TextConfig(
        vocab_size=len(tok), hidden_size=cfg.text_dim, intermediate_size=2 * cfg.text_dim,
        num_hidden_layers=cfg.text_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=1024, sliding_window=16, vocab_size_per_layer_input=len(tok),
        hidden_size_per_layer_input=0, layer_types=["sliding_attention"] * (cfg.text_layers - 1) + ["full_attention"],
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=None, audio_config=None))


def tiny_transformer(cfg: TinyLTX2Config):
    """The random-weight diffusers ``LTX2VideoTransformer3DModel`` of ``cfg``."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(cfg.seed)
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    switches = {} if not cfg.ltx23 else dict(
        cross_attn_mod=True, audio_cross_attn_mod=True, gated_attn=True, audio_gated_attn=True,
        use_prompt_embeddings=False, use_prompt_adaln_single=cfg.prompt_adaln,
    )
    return LTX2VideoTransformer3DModel(
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        cross_attention_dim=inner,
        audio_in_channels=cfg.audio_latent_channels * cfg.mel_bins // 4,
        audio_out_channels=cfg.audio_latent_channels * cfg.mel_bins // 4,
        audio_num_attention_heads=cfg.num_attention_heads,
        audio_attention_head_dim=cfg.attention_head_dim // 2,
        audio_cross_attention_dim=inner // 2,
        num_layers=cfg.num_layers,
        caption_channels=cfg.text_dim,
        rope_double_precision=False,
        rope_type="split",
        **switches,
    )


def tiny_connectors(cfg: TinyLTX2Config):
    """``LTX2TextConnectors`` (LTX-2.0's: one projection of all Gemma layers, a video and an audio connector with
    learnable registers) whose outputs have the transformer's caption width; with ``cfg.ltx23`` LTX-2.3's (a projection
    per stream, ``per_modality_projections``, to each stream's width, and gated connector attention)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    video_dim = cfg.num_attention_heads * cfg.attention_head_dim if cfg.ltx23 else cfg.text_dim
    audio_dim = video_dim // 2 if cfg.ltx23 else cfg.text_dim
    switches = {} if not cfg.ltx23 else dict(
        per_modality_projections=True, video_hidden_dim=video_dim, audio_hidden_dim=audio_dim, proj_bias=True,
        video_gated_attn=True, audio_gated_attn=True,
    )
    return LTX2TextConnectors(
        caption_channels=cfg.text_dim,
        text_proj_in_factor=cfg.text_layers + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=video_dim // 2,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=cfg.registers,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=audio_dim // 2,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=cfg.registers,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
        **switches,
    )


def tiny_vae(cfg: TinyLTX2Config):
    """A random ``AutoencoderKLLTX2Video`` with LTX-2's geometry and random per-channel latent statistics."""
    from diffusers import AutoencoderKLLTX2Video

    ch = cfg.vae_channels
    vae = AutoencoderKLLTX2Video(
        latent_channels=cfg.latent_channels,
        block_out_channels=(ch,) * 4,
        decoder_block_out_channels=(ch,) * 3,
        layers_per_block=(1,) * 5,
        decoder_layers_per_block=(1,) * 4,
        upsample_residual=(False,) * 3,
        upsample_factor=(1,) * 3,
        spatial_compression_ratio=32,  # as LTX-2's vae/config.json states them
        temporal_compression_ratio=8,
    )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn(cfg.latent_channels) * 0.1)
        vae.latents_std.copy_(torch.rand(cfg.latent_channels) * 0.5 + 0.5)
    return vae.eval()


def tiny_audio_vae(cfg: TinyLTX2Config):
    from diffusers import AutoencoderKLLTX2Audio

    return AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=cfg.audio_latent_channels, norm_type="pixel", causality_axis="height",
        dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
        mel_bins=cfg.mel_bins,
    )


def tiny_vocoder(cfg: TinyLTX2Config):
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    return LTX2Vocoder(
        in_channels=2 * cfg.mel_bins, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    )


def parts(cfg: TinyLTX2Config) -> dict[str, tiny.Part]:
    """The ``LTX2Pipeline`` components of ``cfg``, in build order."""
    tok = tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_vae(cfg), seed=cfg.seed + 1),
        "audio_vae": tiny.Part(lambda: tiny_audio_vae(cfg), seed=cfg.seed + 2),
        "vocoder": tiny.Part(lambda: tiny_vocoder(cfg), seed=cfg.seed + 3),
        "text_encoder": tiny.Part(lambda: (gemma4 if cfg.gemma4 else gemma3)(tok, cfg), seed=cfg.seed + 4),
        "tokenizer": tiny.Part(lambda: tok),
        "connectors": tiny.Part(lambda: tiny_connectors(cfg), seed=cfg.seed + 5),
        # LTX-2's own scheduler settings (scheduler/scheduler_config.json of Lightricks/LTX-2)
        "scheduler": tiny.Part(
            lambda: tiny.flow_scheduler(
                use_dynamic_shifting=True, base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95,
                max_shift=2.05, shift_terminal=0.1,
            )
        ),
    }


def single_file_path(folder: Path) -> Path:
    """Where :func:`write_tiny_ltx2` puts the original-layout single file by default."""
    return tiny.beside(folder, ".ltx2.safetensors")


def write_tiny_ltx2(
    folder: Path, cfg: TinyLTX2Config | None = None, single_file: Path | None = None, pipeline: str = "LTX2Pipeline"
) -> Path:
    """Save a tiny LTX-2 pipeline folder (``pipeline``: ``LTX2Pipeline`` or ``LTX2ImageToVideoPipeline``) at
    ``folder`` and its transformer in the original Lightricks layout (keys under ``model.diffusion_model.``, beside
    the connectors' original tensors, as downloaded files hold them) at ``single_file`` (default
    ``<folder>.ltx2.safetensors``)."""
    folder = Path(folder)
    pipe = tiny.write_pipeline(pipeline, parts(cfg or TinyLTX2Config()), folder)
    _write_single_file(pipe.transformer, pipe.connectors, Path(single_file or single_file_path(folder)))
    return folder


def _write_single_file(transformer, connectors, file: Path) -> None:
    original = layout_for_config(transformer.config).to_original(transformer.state_dict())
    # what else a downloaded file holds under the transformer's prefix (ignored when loading the transformer)
    original.update({f"model.diffusion_model.video_embeddings_connector.{k}": v.clone()
                     for k, v in connectors.video_connector.state_dict().items()})
    if connectors.config.per_modality_projections:  # LTX-2.3's feature extractor: one projection per stream
        for stream in ("video", "audio"):
            for k, v in getattr(connectors, f"{stream}_text_proj_in").state_dict().items():
                original[f"text_embedding_projection.{stream}_aggregate_embed.{k}"] = v.clone()
    else:
        original["text_embedding_projection.aggregate_embed.weight"] = connectors.text_proj_in.weight.clone()
    tiny.save_single_file(original, file)


def write_tiny_ltx23(folder: Path, single_file: Path | None = None) -> Path:
    """A tiny LTX-2.3 ``LTX2Pipeline`` folder (:class:`TinyLTX2Config` with ``ltx23``: ``cross_attn_mod``, prompt
    adaLN, gated attention, per-stream connector projections, no caption projection) and its single file."""
    return write_tiny_ltx2(folder, TinyLTX2Config(ltx23=True), single_file)


def write_tiny_ltx25(folder: Path, single_file: Path | None = None) -> Path:
    """A tiny LTX-2.5 ``LTX25ModularPipeline`` folder (``modular_model_index.json``, as
    ``ModularPipeline.save_pretrained`` writes it): LTX-2.3's layout with ``use_prompt_adaln_single = false`` (static
    prompt tables), a Gemma 4 text encoder, the convolutional VAE kept for encoding and decoding (no diffusion
    decoder), and its single file."""
    from diffusers.modular_pipelines import LTX25AutoBlocks

    folder = Path(folder)
    built = tiny.build_components(parts(TinyLTX2Config(ltx23=True, prompt_adaln=False, gemma4=True)))
    pipe = LTX25AutoBlocks().init_pipeline()
    pipe.update_components(**built)
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)
    _write_single_file(built["transformer"], built["connectors"], Path(single_file or single_file_path(folder)))
    return folder


#: Gemma 3's language model prefixes as transformers saves them and as it loads them
LANGUAGE_MODEL = ("language_model.model.", "model.language_model.")


def write_comfy_files(folder: Path, out: Path, checkpoint: str = "ltx-2-19b-dev.safetensors") -> dict[str, Path]:
    """The tiny LTX-2 (2.0, 2.3 or 2.5) ``folder`` as ComfyUI's files under ``out``: ``checkpoint`` (the transformer
    and text connectors under ``model.diffusion_model.`` / ``text_embedding_projection.``, ``vae.*``, ``audio_vae.*``
    in the original Lightricks layouts, a vocoder tensor), ``gemma`` (ComfyUI's Gemma 3 file: the language model
    under ``model.``, no vision tower) and ``configs`` (a config-only copy of the folder)."""
    import json

    from diffpipe_core.testing.component_files import component_state, config_only, save
    from diffpipe_ltx.lightricks_vae import ltx2_audio_vae_table, ltx2_vae_table
    from diffpipe_ltx.ltx2_original import connectors_table

    def config(component: str) -> dict:
        return json.loads((folder / component / "config.json").read_text())

    state = layout_for_config(config("transformer")).to_original(component_state(folder, "transformer"))
    state.update(connectors_table(config("connectors")).to_original(component_state(folder, "connectors")))
    state.update(ltx2_vae_table(config("vae")).to_original(component_state(folder, "vae")))
    state.update(ltx2_audio_vae_table(config("audio_vae")).to_original(component_state(folder, "audio_vae")))
    state["vocoder.conv_pre.weight"] = torch.ones(4, 8, 7)  # the vocoder: not diffpipe's, ignored
    gemma = component_state(folder, "text_encoder")
    text = {"model." + k[len(p) :]: v for k, v in gemma.items() for p in LANGUAGE_MODEL if k.startswith(p)}
    return {
        "checkpoint": save(state, out / checkpoint),
        "gemma": save(text, out / "gemma_3_12B_it.safetensors"),
        "configs": config_only(folder, out / "configs"),
    }


def write_clips(folder: Path, captions: list[str] | tuple[str, ...], frames: int, size: tuple[int, int],
                audio: str | None = None) -> list[Path]:
    """``clip_000.mp4``, ... at 24 fps (the model's rate), ``size`` = (width, height), each with its caption file
    and, with ``audio = "tone"``, a 440 Hz tone track (:func:`diffpipe_core.testing.media.write_video`)."""
    from diffpipe_core.testing.media import write_clip_dataset

    return write_clip_dataset(folder, frames, captions, size, fps=FRAME_RATE, audio=audio)


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_ltx.ltx2_testing FOLDER [--clips DIR]``: write a tiny LTX-2 (folder +
    ``FOLDER.ltx2.safetensors``) and, with ``--clips``, four short captioned mp4 clips for a demo dataset."""
    clips = lambda d: write_clips(d, CLIP_CAPTIONS, frames=25, size=(64, 64))  # noqa: E731
    what = "4 captioned 1 s mp4 clips (24 fps, 64x64)"
    tiny.video_demo_main(argv, main.__doc__, write_tiny_ltx2, single_file_path, (what, clips, len(CLIP_CAPTIONS)))


if __name__ == "__main__":
    main()
