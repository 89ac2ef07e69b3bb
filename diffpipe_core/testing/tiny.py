"""Tiny random-weight components for tests, demos and benchmarks, and writing a pipeline folder from a table of them.

A plugin's ``testing.py`` names its pipeline's components and how to build each one, in order, with the seed to
set before it (None: go on with the generator's state), and :func:`write_pipeline` builds and saves them::

    folder = write_pipeline("FluxPipeline", {
        "transformer": Part(lambda: FluxTransformer2DModel(...), seed=0),
        "vae": Part(lambda: autoencoder_kl(latent_channels=4), seed=1),
        "tokenizer": Part(lambda: clip_tok),
        "text_encoder": Part(lambda: clip_text(clip_tok, dim=32)),
        ...
    }, path)

Everything is built in-process (tokenizers are trained on a word list: no hub access) and saved in the real
on-disk formats, so the plugin's real loading code is what the tests run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.testing.tokenizers import word_level_tokenizer

#: words every tiny tokenizer knows (captions in tests and demos use them)
WORDS = (
    "a photo of cat dog red blue green house tree sky with on in the caption image small large "
    "bright dark river mountain city car person painting style 0 1 2 3 4 5 6 7 8 9"
).split()


@dataclass
class TinySizes:
    """The sizes every tiny diffusion transformer has; a plugin's ``Tiny*Config`` subclasses it, adds its own fields
    and restates a default that differs."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    latent_channels: int = 4
    text_dim: int = 32
    seed: int = 0


@dataclass(frozen=True)
class Part:
    """One pipeline component: ``build()`` makes it, after ``torch.manual_seed(seed)`` when ``seed`` is given."""

    build: Callable[[], Any]
    seed: int | None = None


def build_components(parts: dict[str, Part]) -> dict[str, Any]:
    """The components, built in the table's order (which, with the seeds, fixes every random weight)."""
    out = {}
    for name, part in parts.items():
        if part.seed is not None:
            torch.manual_seed(part.seed)
        component = part.build()
        out[name] = component.eval() if isinstance(component, torch.nn.Module) else component
    return out


def pipeline(pipeline_class: str, parts: dict[str, Part]) -> Any:
    """A diffusers pipeline of ``pipeline_class`` from the built components (not yet on disk)."""
    import diffusers

    return getattr(diffusers, pipeline_class)(**build_components(parts))


def write_pipeline(pipeline_class: str, parts: dict[str, Part], folder: Path) -> Any:
    """Build the pipeline and ``save_pretrained`` it (safetensors) to ``folder``; returns the pipeline."""
    pipe = pipeline(pipeline_class, parts)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return pipe


def write_folder(pipeline_class: str, parts: dict[str, Part], folder: Path) -> Path:
    """Build the components and save each with its own ``save_pretrained`` under ``folder/<name>``, plus the
    ``model_index.json`` diffusers writes, naming ``pipeline_class``: a diffusers folder for a model diffusers has no
    pipeline class for (a plugin's own diffusion model). Returns ``folder``."""
    import json

    import diffusers

    folder = Path(folder)
    index: dict[str, Any] = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__}
    for name, component in build_components(parts).items():
        kwargs = {"safe_serialization": True} if isinstance(component, torch.nn.Module) else {}
        component.save_pretrained(str(folder / name), **kwargs)
        module = type(component).__module__
        top = module.partition(".")[0]
        index[name] = [top if top in ("diffusers", "transformers") else module, type(component).__name__]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def save_single_file(state: dict[str, torch.Tensor], file: Path) -> Path:
    """``state`` (e.g. a key table's ``to_original`` of the transformer) as one safetensors file."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(file), metadata={"format": "pt"})
    return file


# ---------------------------------------------------------------------------------------------- tokenizers
def clip_tokenizer(words: Sequence[str] = WORDS, specials: Sequence[str] = ("<pad>", "</s>", "<unk>", "<s>")) -> Any:
    """A CLIP-like tokenizer (``<s> caption </s>``, 77 tokens)."""
    return word_level_tokenizer(
        words, specials, "<s> $A </s>", 77, pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )


def t5_tokenizer(
    words: Sequence[str] = WORDS, max_length: int = 512, specials: Sequence[str] = ("<pad>", "</s>", "<unk>", "<s>")
) -> Any:
    """A T5-like tokenizer (``caption </s>``)."""
    names = {"pad_token": "<pad>", "eos_token": "</s>"}
    if "<s>" in specials:
        names["bos_token"] = "<s>"
    return word_level_tokenizer(words, specials, "$A </s>", max_length, **names)


#: the pre-tokenizer split (regex) of Qwen2 / Qwen2.5(-VL) tokenizers
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Llama-3's: numbers in runs of up to three digits
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def bpe_tokenizer(
    texts: Sequence[str],
    specials: Sequence[str],
    template: str,
    max_length: int,
    split: str | None = None,
    vocab_size: int = 4096,
    **names: str,
) -> Any:
    """A tiny byte-level BPE tokenizer (the kind Qwen, Llama-3 and GPT-style encoders use) trained on ``texts``.

    Trained on a model's prompt template (and the test captions) with room for every merge, it cuts each
    pre-token of the template into one token, as a real BPE tokenizer cuts common words, so the template's prefix
    has the real tokenizer's token count (Qwen-Image's 34 with :data:`QWEN2_SPLIT`, HunyuanVideo's 95 with
    :data:`LLAMA3_SPLIT`: what their pipelines drop) and ``drop_tokens`` computed from it is the real one.
    ``split``: the real tokenizer's pre-tokenizer regex, else GPT-2's byte-level one. ``specials`` stay single
    tokens; ``template`` is the post-processor (``"$A"`` for none); ``names`` are the special-token roles
    (``pad_token="<|endoftext|>"``, ...)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # no progress bars: the demo's model writers print one line of their own
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    if template != "$A":
        specials_in = [s for s in specials if s in template]
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(s, tok.token_to_id(s)) for s in specials_in]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **names)


#: Qwen3's chat template, cut to what ZImagePipeline and Flux2KleinPipeline use: user messages, the generation
#: prompt, and the empty thinking block ``enable_thinking=False`` adds
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def qwen3_tokenizer(max_length: int = 512) -> Any:
    """A Qwen3-like byte-level BPE tokenizer (Qwen2's pre-tokenizer split, ``<|endoftext|>`` padding) with Qwen3's
    chat template, trained on the template and :data:`WORDS`."""
    texts = ["<|im_start|>user\n a photo <|im_end|>\n<|im_start|>assistant\n", " ".join(WORDS)]
    tok = bpe_tokenizer(
        texts, QWEN3_SPECIALS, "$A", max_length, split=QWEN2_SPLIT, pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
    )
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


#: Qwen2-VL's chat template, cut to text: a default system turn when the conversation has none, message contents
#: given as a string or as a list of ``{"type": "text", "text": ...}`` parts, the generation prompt
QWEN2_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN2_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     "<|image_pad|>", "<|video_pad|>"]


def qwen2_vl_tokenizer(texts: Sequence[str] = (), max_length: int = 512) -> Any:
    """A Qwen2.5-VL-like byte-level BPE tokenizer (Qwen2's pre-tokenizer split, ``<|endoftext|>`` padding, the vision
    tokens atomic) with Qwen2-VL's chat template (text parts only), trained on ``texts`` and :data:`WORDS`."""
    tok = bpe_tokenizer(
        ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n", *texts, " ".join(WORDS)],
        QWEN2_VL_SPECIALS, "$A", max_length, split=QWEN2_SPLIT, pad_token="<|endoftext|>", eos_token="<|im_end|>",
    )
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    return tok


# ---------------------------------------------------------------------------------------------- encoders
def clip_text(tokenizer: Any, dim: int = 32, layers: int = 2, projection: bool = False, max_positions: int = 77) -> Any:
    """A CLIP text encoder (``CLIPTextModel``, or ``CLIPTextModelWithProjection`` with ``projection``)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_attention_heads=2,
        num_hidden_layers=layers,
        max_position_embeddings=max_positions,
        projection_dim=dim,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def t5_encoder(
    tokenizer: Any, dim: int = 32, layers: int = 2, heads: int = 4, d_kv: int = 8, umt5: bool = False
) -> Any:
    """A T5 encoder (``T5EncoderModel``, or ``UMT5EncoderModel`` with ``umt5``)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    kwargs = dict(
        vocab_size=len(tokenizer),
        d_model=dim,
        d_kv=d_kv,
        d_ff=2 * dim,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return UMT5EncoderModel(UMT5Config(**kwargs)) if umt5 else T5EncoderModel(T5Config(**kwargs))


def decoder_config(
    config_class: Any, tokenizer: Any, dim: int, layers: int, heads: int = 4, kv_heads: int = 2, **keys: Any
) -> Any:
    """A transformers config of a tiny decoder-only text encoder (Llama, Qwen3, ...): ``tokenizer``'s vocabulary
    and special tokens, width ``dim`` (MLP ``2 * dim``), ``layers`` layers of ``heads`` query and ``kv_heads``
    key/value heads, 1024 positions, then ``keys``."""
    return config_class(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": dim,
            "intermediate_size": 2 * dim,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 1024,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            **keys,
        }
    )


def llama(tokenizer: Any, dim: int = 32, layers: int = 2, positions: int = 1024) -> Any:
    """A ``LlamaModel`` (decoder-only text encoder)."""
    from transformers import LlamaConfig, LlamaModel

    keys = {"max_position_embeddings": positions, "bos_token_id": tokenizer.bos_token_id}
    return LlamaModel(decoder_config(LlamaConfig, tokenizer, dim, layers, **keys))


def qwen25_vl(tokenizer: Any, dim: int = 32, layers: int = 2) -> Any:
    """A ``Qwen2_5_VLForConditionalGeneration`` of ``layers`` text layers (4 heads, 2 KV heads, multimodal RoPE split
    ``[1, 1, 2]`` of the head's 4 frequencies at ``dim`` 32) and a 1-block vision tower, for :func:`qwen2_vl_tokenizer`
    (its vision tokens)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    half = dim // 8  # head_dim / 2 frequencies, split (time, height, width)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [half // 4, half // 4, half - 2 * (half // 4)]}
    tokens = {"image": "image_pad", "video": "video_pad", "vision_start": "vision_start", "vision_end": "vision_end"}
    ids = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(f"<|{token}|>") for role, token in tokens.items()}
    text = dict(vocab_size=len(tokenizer), hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=dim, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, **ids)
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen3_vl(tokenizer: Any, dim: int = 32, layers: int = 2, head: bool = True) -> Any:
    """A ``Qwen3VLForConditionalGeneration`` of ``layers`` text layers (4 heads of 8, 2 KV heads, interleaved
    multimodal RoPE ``[1, 1, 2]``) and a 1-block vision tower at 16-pixel patches, for :func:`qwen3_vl_processor`'s
    tokenizer (its vision tokens): the text encoder of Qwen-Image 2.1 (and of the Qwen3-VL-conditioned models).
    ``head=False``: the bare ``Qwen3VLModel`` (no language-model head), Krea 2's text encoder."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLModel

    tokens = {"image": "image_pad", "video": "video_pad", "vision_start": "vision_start", "vision_end": "vision_end"}
    ids = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(f"<|{token}|>") for role, token in tokens.items()}
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [1, 1, 2], "mrope_interleaved": True}
    text = dict(vocab_size=len(tokenizer), hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                pad_token_id=tokenizer.pad_token_id, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=dim, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
    cls = Qwen3VLForConditionalGeneration if head else Qwen3VLModel
    return cls(Qwen3VLConfig(text_config=text, vision_config=vision, **ids))


def qwen3_vl_processor(texts: Sequence[str] = ()) -> Any:
    """A ``Qwen3VLProcessor`` without its video half (:class:`~diffpipe_core.parts.vl_processors.
    ImageOnlyQwen3VLProcessor`): :func:`qwen2_vl_tokenizer` trained on ``texts`` (a pipeline's prompt template),
    the PIL image processor at 16-pixel patches (up to 16 merged patches), Qwen2-VL's chat template (text parts)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffpipe_core.parts.vl_processors import ImageOnlyQwen3VLProcessor

    images = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=32 * 32 * 16, patch_size=16)
    return ImageOnlyQwen3VLProcessor(image_processor=images, tokenizer=qwen2_vl_tokenizer(texts), video_processor=None,
                                     chat_template=QWEN2_VL_CHAT_TEMPLATE)


# ---------------------------------------------------------------------------------------------- VAEs
def wan_vae(z_dim: int, **config: Any) -> Any:
    """A random ``AutoencoderKLWan`` with Wan 2.1's geometry (8x spatial, 4x temporal) at the smallest width (base
    dim 8, one residual block per level); ``config`` adds the rest (``latents_mean`` / ``latents_std``, Wan 2.2's
    16x settings)."""
    from diffusers import AutoencoderKLWan

    geometry = {"dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True, True]}
    return AutoencoderKLWan(base_dim=8, z_dim=z_dim, **geometry, **config)


def beside(folder: Path, suffix: str) -> Path:
    """``<folder><suffix>`` next to ``folder``: where a tiny model's writer puts its single file."""
    folder = Path(folder)
    return folder.with_name(folder.name + suffix)


def folder_parser(description: str | None) -> argparse.ArgumentParser:
    """The command line of a plugin's ``testing`` module (``python -m <package>.testing FOLDER ...``): a parser with
    the ``FOLDER`` argument. From here on the libraries' chatter stays behind ``DIFFPIPE_VERBOSE=1``, as in the CLI."""
    from diffpipe_core.quiet import quiet_script

    quiet_script()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("folder", type=Path)
    return parser


def video_demo_main(
    argv: list[str] | None,
    description: str | None,
    write_model: Callable[[Path], Path],
    single_file: Callable[[Path], Path],
    clips: tuple[str, Callable[[Path], Any], int],
) -> None:
    """A video plugin's ``python -m <package>.testing FOLDER [--clips DIR]``: ``write_model(FOLDER)`` (a folder and
    its ``single_file(folder)``), and with ``--clips`` the demo dataset ``clips = (what, write(DIR), count)``."""
    parser = folder_parser(description)
    parser.add_argument("--clips", type=Path, help=f"also write {clips[0]} here")
    args = parser.parse_args(argv)
    folder = write_model(args.folder)
    print(f"wrote {folder} and {single_file(folder)}")
    demo_clips(args.clips, clips[1], clips[2])


def demo_clips(clips: Path | None, write: Callable[[Path], Any], count: int) -> None:
    """A tiny model's ``--clips DIR`` (its ``testing`` module's command line): ``write(DIR)`` the ``count`` captioned
    clips of a demo dataset and say so."""
    if clips:
        write(clips)
        print(f"wrote {count} clips to {clips}")


def ldm_levels(channels: tuple[int, ...]) -> dict[str, Any]:
    """The level keys of a tiny LDM-style image VAE (``AutoencoderKL``, ``AutoencoderKLFlux2``): one plain encoder and
    decoder block of one layer per entry of ``channels``, group norms as wide as the narrowest level."""
    n = len(channels)
    return {
        "down_block_types": ("DownEncoderBlock2D",) * n,
        "up_block_types": ("UpDecoderBlock2D",) * n,
        "block_out_channels": channels,
        "layers_per_block": 1,
        "norm_num_groups": min(channels),
    }


def autoencoder_kl(
    latent_channels: int = 4,
    channels: tuple[int, ...] = (8, 8, 8, 8),
    scaling_factor: float = 0.18215,
    shift_factor: float | None = None,
    quant_conv: bool = False,
    sample_size: int = 64,
) -> Any:
    """An image ``AutoencoderKL`` (``len(channels)`` levels: factor ``2 ** (levels - 1)``)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        **ldm_levels(channels),
        latent_channels=latent_channels,
        sample_size=sample_size,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=quant_conv, use_post_quant_conv=quant_conv,
    )


def hunyuan_video_vae(latent_channels: int = 4, channels: tuple[int, ...] = (8, 8, 8, 8)) -> Any:
    """A causal video VAE (``AutoencoderKLHunyuanVideo``): 8x spatial and 4x temporal compression with 4 levels
    (frames ``4k + 1``; an image is one frame), ``latents * scaling_factor`` normalisation."""
    from diffusers import AutoencoderKLHunyuanVideo

    groups = min(channels) // 2
    return AutoencoderKLHunyuanVideo(
        latent_channels=latent_channels, block_out_channels=channels, layers_per_block=1, norm_num_groups=groups
    )


def flux2_vae(latent_channels: int = 4, channels: tuple[int, ...] = (8, 8)) -> Any:
    """An ``AutoencoderKLFlux2`` (factor ``2 ** (len(channels) - 1)``, FLUX.2's and Ideogram 4's VAE) whose batch-norm
    statistics are random, so the normalisation counts."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**ldm_levels(channels), latent_channels=latent_channels, sample_size=64)
    with torch.no_grad():
        vae.bn.running_mean.normal_(0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def flow_scheduler(**config: Any) -> Any:
    """A ``FlowMatchEulerDiscreteScheduler`` with ``config``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**config)
