"""Write a tiny random-weight Flux (or Chroma) to disk in its real layouts, for tests, the demo and benchmarks.

:func:`write_tiny_flux` saves a complete diffusers ``FluxPipeline`` folder (``model_index.json``, ``transformer/``,
``vae/``, ``text_encoder/`` (CLIP-L-like), ``text_encoder_2/`` (T5), ``tokenizer/``, ``tokenizer_2/``,
``scheduler/``) and, beside it, the same transformer as one safetensors file in the original BFL key layout
(``double_blocks.0.img_attn.qkv.weight``, ...), as Flux checkpoints are downloaded. :func:`write_tiny_chroma` does
the same for a ``ChromaPipeline`` (T5 only) and Chroma's original single-file layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffpipe_core.testing import tiny
from diffpipe_flux.bfl import diffusers_to_bfl


@dataclass
class TinyFluxConfig(tiny.TinySizes):
    """Sizes of the tiny Flux (``text_dim``: T5 d_model = joint_attention_dim). ``guidance_embeds=True`` is dev-like,
    False schnell-like."""

    num_single_layers: int = 2
    axes_dims_rope: tuple[int, int, int] = (4, 4, 8)
    guidance_embeds: bool = True
    clip_dim: int = 32  # CLIP hidden = pooled_projection_dim
    vae_channels: tuple[int, ...] = field(default=(8, 8, 8, 8))  # 4 levels: factor 8, like Flux's VAE


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


def parts(cfg: TinyFluxConfig) -> dict[str, tiny.Part]:
    """The ``FluxPipeline`` components of ``cfg``, in build order."""
    clip_tok, t5_tok = tiny.clip_tokenizer(), tiny.t5_tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(
            lambda: tiny.autoencoder_kl(cfg.latent_channels, cfg.vae_channels, 0.3611, 0.1159), seed=cfg.seed + 1
        ),
        "text_encoder": tiny.Part(lambda: tiny.clip_text(clip_tok, cfg.clip_dim)),
        "text_encoder_2": tiny.Part(lambda: tiny.t5_encoder(t5_tok, cfg.text_dim)),
        "tokenizer": tiny.Part(lambda: clip_tok),
        "tokenizer_2": tiny.Part(lambda: t5_tok),
        "scheduler": tiny.Part(
            lambda: tiny.flow_scheduler(
                shift=3.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            )
        ),
    }


def tiny_pipeline(cfg: TinyFluxConfig):
    """A complete random-weight ``FluxPipeline`` (not yet on disk)."""
    return tiny.pipeline("FluxPipeline", parts(cfg))


def write_tiny_flux(folder: Path, cfg: TinyFluxConfig | None = None, bfl_file: Path | None = None) -> Path:
    """Save a tiny Flux pipeline folder at ``folder`` and its transformer as a BFL single file at
    ``bfl_file`` (default ``<folder>.bfl.safetensors``, beside the folder). Returns ``folder``."""
    folder = Path(folder)
    pipe = tiny.write_pipeline("FluxPipeline", parts(cfg or TinyFluxConfig()), folder)
    tiny.save_single_file(
        diffusers_to_bfl(pipe.transformer.state_dict()), Path(bfl_file) if bfl_file else bfl_path(folder)
    )
    return folder


def comfy_lora_keys(n_double: int, n_single: int) -> set[str]:
    """The keys of a ComfyUI LoRA (``diffusion_model.``, BFL names, with ``.alpha``) on every linear of ``n_double``
    double and ``n_single`` single blocks: what the Flux family's tiny runs save."""
    double = ("img_attn.qkv", "txt_attn.qkv", "img_attn.proj", "txt_attn.proj", "img_mlp.0", "img_mlp.2")
    modules = [f"double_blocks.{i}.{m}" for i in range(n_double) for m in (*double, "txt_mlp.0", "txt_mlp.2")]
    modules += [f"single_blocks.{i}.{m}" for i in range(n_single) for m in ("linear1", "linear2")]
    return {f"diffusion_model.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}


def transformer_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs for the default tiny Flux transformer: 2 samples of 8x8 image and 16 text tokens."""
    from diffpipe_flux.packing import image_ids, text_ids

    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(2, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 16, 32, generator=g),
        "pooled_projections": torch.randn(2, 32, generator=g),
        "timestep": torch.rand(2, generator=g),
        "guidance": torch.ones(2),
        "img_ids": image_ids(8, 8).float(),
        "txt_ids": text_ids(16).float(),
    }


def pipeline_latents(pipe, texts, noise: torch.Tensor, steps: int, cfg_scale: float = 1.0, **kwargs) -> torch.Tensor:
    """A Flux or Kontext pipeline's final latents (unpacked) from ``noise`` ``(1, C, h, w)`` and diffpipe's encoded
    prompt ``texts``, guidance 3.5; true CFG on its negative embeddings where ``cfg_scale > 1``."""
    from diffpipe_flux.packing import pack, unpack

    if cfg_scale > 1:
        kwargs |= {
            "negative_prompt_embeds": texts.uncond["t5_embeds"],
            "negative_pooled_prompt_embeds": texts.uncond["clip_pooled"],
            "true_cfg_scale": cfg_scale,
        }
    h, w = noise.shape[-2:]
    out = pipe(
        prompt_embeds=texts.cond["t5_embeds"],
        pooled_prompt_embeds=texts.cond["clip_pooled"],
        latents=pack(noise),
        num_inference_steps=steps,
        guidance_scale=3.5,
        height=8 * h,
        width=8 * w,
        output_type="latent",
        **kwargs,
    ).images
    return unpack(out, h, w)


def bfl_path(folder: Path) -> Path:
    """Where :func:`write_tiny_flux` puts the BFL single file by default."""
    return tiny.beside(folder, ".bfl.safetensors")


@dataclass
class TinyChromaConfig(TinyFluxConfig):
    """Sizes of the tiny Chroma: Flux's, plus the modulation approximator's."""

    approximator_num_channels: int = 16  # 4 x the timestep embedding's width
    approximator_hidden_dim: int = 32
    approximator_layers: int = 2


def tiny_chroma_transformer(cfg: TinyChromaConfig):
    """The random-weight diffusers ``ChromaTransformer2DModel`` of ``cfg``."""
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(cfg.seed)
    return ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4 * cfg.latent_channels,
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.text_dim,
        axes_dims_rope=cfg.axes_dims_rope,
        approximator_num_channels=cfg.approximator_num_channels,
        approximator_hidden_dim=cfg.approximator_hidden_dim,
        approximator_layers=cfg.approximator_layers,
    )


def chroma_parts(cfg: TinyChromaConfig) -> dict[str, tiny.Part]:
    """The ``ChromaPipeline`` components of ``cfg``: Flux's transformer, VAE and scheduler roles, T5 alone."""
    flux = parts(cfg)
    t5_tok = tiny.t5_tokenizer()
    return {
        "transformer": tiny.Part(lambda: tiny_chroma_transformer(cfg)),
        "vae": flux["vae"],
        "text_encoder": tiny.Part(lambda: tiny.t5_encoder(t5_tok, cfg.text_dim)),
        "tokenizer": tiny.Part(lambda: t5_tok),
        "scheduler": flux["scheduler"],
    }


def write_tiny_chroma(folder: Path, cfg: TinyChromaConfig | None = None) -> Path:
    """Save a tiny ``ChromaPipeline`` folder at ``folder`` and its transformer in Chroma's original single-file
    layout at :func:`bfl_path` of it. Returns ``folder``."""
    from diffpipe_flux.chroma_keys import layout_for_config as chroma_layout_for_config

    folder = Path(folder)
    pipe = tiny.write_pipeline("ChromaPipeline", chroma_parts(cfg or TinyChromaConfig()), folder)
    table = chroma_layout_for_config(pipe.transformer.config)
    tiny.save_single_file(table.to_original(pipe.transformer.state_dict()), bfl_path(folder))
    return folder


@dataclass
class TinyFlux2Config:
    """Sizes of the tiny FLUX.2 (head dim 16 = rotary axes 4 x 4). ``guidance_embeds``: dev (True) or Klein (False).
    The text encoder has the layer count the pipelines read from (Klein's hidden states 9, 18, 27)."""

    num_layers: int = 2
    num_single_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, ...] = (4, 4, 4, 4)
    latent_channels: int = 4  # x 4 after the 2x2 patches = the transformer's in_channels
    guidance_embeds: bool = False
    text_dim: int = 16  # the text encoder's hidden size; 3 stacked layers = joint_attention_dim
    text_layers: int = 28
    vae_channels: tuple[int, ...] = field(default=(8, 8, 8, 8))
    seed: int = 0


def tiny_flux2_transformer(cfg: TinyFlux2Config):
    """The random-weight diffusers ``Flux2Transformer2DModel`` of ``cfg``."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(cfg.seed)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * cfg.latent_channels,
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=3 * cfg.text_dim,
        timestep_guidance_channels=32,
        axes_dims_rope=tuple(cfg.axes_dims_rope),
        guidance_embeds=cfg.guidance_embeds,
    )


def tiny_flux2_vae(cfg: TinyFlux2Config):
    """The core's tiny ``AutoencoderKLFlux2`` of ``cfg``'s channels (random batch-norm statistics)."""
    return tiny.flux2_vae(cfg.latent_channels, tuple(cfg.vae_channels))


def qwen3_causal(tokenizer, cfg: TinyFlux2Config):
    """A tiny ``Qwen3ForCausalLM`` (Klein's text encoder)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = tiny.decoder_config(Qwen3Config, tokenizer, cfg.text_dim, cfg.text_layers, 2, 1, head_dim=8)
    return Qwen3ForCausalLM(config)


def flux2_parts(cfg: TinyFlux2Config, text_encoder, tokenizer) -> dict[str, tiny.Part]:
    """A FLUX.2 pipeline's components in build order, with ``text_encoder(tokenizer, cfg)``."""
    return {
        "transformer": tiny.Part(lambda: tiny_flux2_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_flux2_vae(cfg), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: text_encoder(tokenizer, cfg), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tokenizer),
        "scheduler": tiny.Part(
            lambda: tiny.flow_scheduler(
                shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                max_image_seq_len=4096, time_shift_type="exponential",
            )
        ),
    }


def klein_parts(cfg: TinyFlux2Config) -> dict[str, tiny.Part]:
    """The ``Flux2KleinPipeline`` components of ``cfg`` (Qwen3 and its chat-template tokenizer)."""
    return flux2_parts(cfg, qwen3_causal, tiny.qwen3_tokenizer())


#: A Mistral chat template cut to what Flux2Pipeline renders: the system message and the user's caption, each as a
#: text content item (or a string)
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}{%- else %}{%- set text = message['content'][0]['text'] %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{{- '[INST]' + text + '[/INST]' }}{%- endif %}{%- endfor %}"
)
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>"]


def mistral_tokenizer():
    """A Mistral-like byte-level BPE tokenizer with the chat template, trained on Flux2Pipeline's system message (so
    each of its words is one token) and the test words. Flux2Pipeline's own tokenizer folder is a
    ``PixtralProcessor``, which needs torchvision; the pipeline calls only its ``apply_chat_template``, which a
    tokenizer with the chat template has as well."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tok = tiny.bpe_tokenizer(
        [SYSTEM_MESSAGE, " ".join(tiny.WORDS)], MISTRAL_SPECIALS, "$A", 512, pad_token="<pad>", bos_token="<s>",
        eos_token="</s>", unk_token="<unk>",
    )
    tok.chat_template = MISTRAL_CHAT_TEMPLATE
    return tok


def mistral3(tokenizer, cfg: TinyFlux2Config):
    """A tiny ``Mistral3ForConditionalGeneration`` (FLUX.2 [dev]'s text encoder; its vision tower is never run)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.text_dim, intermediate_size=2 * cfg.text_dim,
        num_hidden_layers=cfg.text_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
    )
    vision = PixtralVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
        image_size=32, patch_size=8,
    )
    return Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision))


def dev_config(**sizes) -> TinyFlux2Config:
    """The tiny FLUX.2 [dev]: guidance embedding, 30 text layers (the pipeline reads hidden states 10, 20, 30)."""
    return TinyFlux2Config(**{"guidance_embeds": True, "text_layers": 30, **sizes})


def dev_parts(cfg: TinyFlux2Config) -> dict[str, tiny.Part]:
    """The ``Flux2Pipeline`` components of ``cfg`` (Mistral3 and its chat-template tokenizer)."""
    return flux2_parts(cfg, mistral3, mistral_tokenizer())


def write_tiny_flux2(folder: Path, cfg: TinyFlux2Config | None = None, pipeline: str = "Flux2Pipeline") -> Path:
    """Save a tiny ``Flux2Pipeline`` (default :func:`dev_config`) or, with ``pipeline="Flux2KleinPipeline"``, a tiny
    Klein at ``folder``, and its transformer in the BFL / ComfyUI FLUX.2 layout at :func:`bfl_path` of it. Returns
    ``folder``."""
    from diffpipe_flux.flux2_keys import layout_for_config as flux2_layout_for_config

    folder = Path(folder)
    klein = pipeline == "Flux2KleinPipeline"
    parts = klein_parts(cfg or TinyFlux2Config()) if klein else dev_parts(cfg or dev_config())
    pipe = tiny.write_pipeline(pipeline, parts, folder)
    table = flux2_layout_for_config(pipe.transformer.config)
    tiny.save_single_file(table.to_original(pipe.transformer.state_dict()), bfl_path(folder))
    return folder


def write_tiny_klein(folder: Path, cfg: TinyFlux2Config | None = None) -> Path:
    """:func:`write_tiny_flux2` of a ``Flux2KleinPipeline``."""
    return write_tiny_flux2(folder, cfg, "Flux2KleinPipeline")


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_flux.testing FOLDER``: write a tiny Flux (folder + ``FOLDER.bfl.safetensors``)."""
    parser = tiny.folder_parser(main.__doc__)
    parser.add_argument("--schnell", action="store_true", help="no guidance embedding (schnell-like)")
    args = parser.parse_args(argv)
    folder = write_tiny_flux(args.folder, TinyFluxConfig(guidance_embeds=not args.schnell))
    print(f"wrote {folder} and {bfl_path(folder)}")


if __name__ == "__main__":
    main()
