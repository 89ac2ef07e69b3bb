"""Write a tiny random-weight MiniMax H3 to disk in its real layout, for tests and benchmarks.

:func:`write_tiny_minimax` saves a ``MiniMaxH3ModularPipeline`` folder as ``ModularPipeline.save_pretrained`` lays it
out (``modular_model_index.json`` naming the components): ``transformer/`` (``MiniMaxH3Transformer3DModel``),
``vae/`` (``AutoencoderKLMiniMaxH3``, 16x spatial, 17 frames to 5 latent frames, non-trivial latent statistics),
``audio_vae/`` (``AutoencoderKLMiniMaxH3Audio`` at 8 kHz with a hop of 200 samples: the model's 40 latents per
second), ``text_encoder/`` (the core's tiny ``Qwen3VLForConditionalGeneration`` of 51 layers, so the pipeline's
``hidden_states[50]`` exists), ``tokenizer/`` and ``processor/`` (the tiny Qwen3-VL processor, saved without its
video half), ``scheduler/`` and ``audio_scheduler/`` (``MiniMaxH3Scheduler`` at the pipeline's shifts 12 and 3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.parts.vl_processors import save_processor
from diffpipe_core.testing import tiny

#: the pipeline reads the text encoder's hidden state after this many layers (``text_encoder_layer``)
TEXT_LAYER = 50
AUDIO_RATE = 8000  # Hz (one AAC takes): encoder rates (4, 5, 10), a hop of 200 samples: 40 audio latents a second


@dataclass
class TinyMiniMaxConfig:
    """Sizes of the tiny MiniMax H3: 2 blocks of width 32 (2 heads of 16, 8 rotary frequencies each), one refiner
    block, 4 video and 8 audio latent channels, text width 32."""

    num_layers: int = 2
    hidden: int = 32
    heads: int = 2
    head_dim: int = 16
    video_channels: int = 4
    audio_channels: int = 8
    text_dim: int = 32
    seed: int = 0


def tiny_transformer(cfg: TinyMiniMaxConfig) -> Any:
    """The random-weight ``MiniMaxH3Transformer3DModel`` of ``cfg`` (norm weights non-trivial)."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(cfg.seed)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=cfg.heads, attention_head_dim=cfg.head_dim, hidden_size=cfg.hidden,
        num_layers=cfg.num_layers, num_refiner_layers=1, ffn_dim=2 * cfg.hidden, in_channels=cfg.video_channels,
        audio_in_channels=cfg.audio_channels, patch_size=(1, 2, 2), text_dim=cfg.text_dim, freq_dim=32,
        time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "adaln_proj" in name or name.startswith(("norm_out.linear", "proj_out", "audio_proj_out")):
                param.normal_(0.0, 0.2)  # diffusers zero-inits none of these, but keep the output well away from 0
    return model


def tiny_vae(channels: int) -> Any:
    """``AutoencoderKLMiniMaxH3`` at the smallest width with MiniMax H3's geometry and per-channel statistics."""
    from diffusers import AutoencoderKLMiniMaxH3

    return AutoencoderKLMiniMaxH3(
        latent_channels=channels, block_out_channels=(8,) * 6, layers_per_block=1, norm_num_groups=4,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=1, latents_mean=[0.1 * i - 0.1 for i in range(channels)],
        latents_std=[0.5 + 0.2 * i for i in range(channels)],
    )


def tiny_audio_vae(channels: int) -> Any:
    """``AutoencoderKLMiniMaxH3Audio`` (mono, 40 latents per second at :data:`AUDIO_RATE`) with statistics."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(4, 5, 10), latent_dim=16, latent_channels=channels, num_attention_heads=2,
        decoder_dim=16, decoder_rates=(10, 5, 4), decoder_kernel_sizes=(20, 10, 8), resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),), sampling_rate=AUDIO_RATE,
        latents_mean=[0.05 * i for i in range(channels)], latents_std=[0.8 + 0.1 * i for i in range(channels)],
    )


def parts(cfg: TinyMiniMaxConfig) -> dict[str, tiny.Part]:
    """The MiniMax H3 components of ``cfg``, in build order."""
    from diffusers import MiniMaxH3Scheduler

    proc = tiny.qwen3_vl_processor(["a red cat walks on the grass <Picture 1>: "])
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_vae(cfg.video_channels), seed=cfg.seed + 1),
        "audio_vae": tiny.Part(lambda: tiny_audio_vae(cfg.audio_channels), seed=cfg.seed + 2),
        "text_encoder": tiny.Part(lambda: tiny.qwen3_vl(proc.tokenizer, cfg.text_dim, TEXT_LAYER + 1),
                                  seed=cfg.seed + 3),
        "tokenizer": tiny.Part(lambda: proc.tokenizer),
        "processor": tiny.Part(lambda: proc),
        "scheduler": tiny.Part(lambda: MiniMaxH3Scheduler(shift=12.0)),
        "audio_scheduler": tiny.Part(lambda: MiniMaxH3Scheduler(shift=3.0)),
    }


#: what ``modular_model_index.json`` names each component's library and class as
INDEX = {
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2TokenizerFast"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
}


def write_tiny_minimax(folder: Path, cfg: TinyMiniMaxConfig | None = None) -> Path:
    """A tiny ``MiniMaxH3ModularPipeline`` folder: each component saved by its own ``save_pretrained`` (the
    processor without its video half), and ``modular_model_index.json`` as ``ModularPipeline.save_pretrained``
    writes it (each component ``[library, class, {"pretrained_model_name_or_path": folder, "subfolder": name}]``)."""
    cfg = cfg or TinyMiniMaxConfig()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    built = tiny.build_components(parts(cfg))
    index: dict[str, Any] = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": _diffusers_version(),
                             "canvas_short_edge": 768, "canvas_max_pixels": 768 * 1344}
    for name, component in built.items():
        if name == "processor":
            save_processor(component, folder / name)
        else:
            component.save_pretrained(str(folder / name))
        library, cls = INDEX[name]
        index[name] = [library, cls, {"pretrained_model_name_or_path": str(folder), "subfolder": name,
                                      "type_hint": [library, cls]}]
    (folder / "modular_model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def load_components(folder: Path) -> dict[str, Any]:
    """The components of a tiny folder (float32), the processor loaded without torchvision."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from diffpipe_core.parts.vl_processors import ImageOnlyQwen3VLProcessor, load_processor

    folder = Path(folder)
    return {
        "transformer": MiniMaxH3Transformer3DModel.from_pretrained(str(folder / "transformer")).eval(),
        "vae": AutoencoderKLMiniMaxH3.from_pretrained(str(folder / "vae")).eval(),
        "audio_vae": AutoencoderKLMiniMaxH3Audio.from_pretrained(str(folder / "audio_vae")).eval(),
        "text_encoder": Qwen3VLForConditionalGeneration.from_pretrained(str(folder / "text_encoder")).eval(),
        "tokenizer": AutoTokenizer.from_pretrained(str(folder / "tokenizer")),
        "processor": load_processor(folder / "processor", ImageOnlyQwen3VLProcessor),
        "scheduler": MiniMaxH3Scheduler.from_pretrained(str(folder / "scheduler")),
        "audio_scheduler": MiniMaxH3Scheduler.from_pretrained(str(folder / "audio_scheduler")),
    }


def modular_pipeline(folder: Path) -> Any:
    """The ``MiniMaxH3ModularPipeline`` (``MiniMaxH3Blocks``) over a tiny folder's components."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**load_components(folder))
    return pipe


def comfyui_qwen3vl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``Qwen3VLForConditionalGeneration`` state dict as ComfyUI's MiniMax H3 text encoder file holds it."""
    from diffpipe_minimax.plugin import QWEN3VL_UNUSED

    renames = (("model.language_model.", "model."), ("model.visual.", "visual."))
    return {next((new + k[len(old):] for old, new in renames if k.startswith(old)), k): v
            for k, v in state.items() if not k.startswith(QWEN3VL_UNUSED)}


def comfyui_files(folder: Path, out: Path) -> dict[str, Path]:
    """A tiny folder's components as the files diffusion-pipe's MiniMax H3 example names (ComfyUI's), under ``out``:
    ``diffusion_model`` (the reference layout under ``model.diffusion_model.``), ``vae`` (the video VAE's reference
    layout), ``audio_vae`` (weight norms folded), both with ComfyUI's latent statistics buffers (and the video VAE's
    ``mask_token``), and ``text_encoder`` (ComfyUI's Qwen3-VL: the language model under ``model.``, the vision tower
    under ``visual.``, cut after layer :data:`TEXT_LAYER`, without the final norm and the head)."""
    from diffpipe_core.testing.component_files import component_state, save
    from diffpipe_minimax.original import layout_for_config
    from diffpipe_minimax.vae_original import audio_vae_table, video_vae_table

    folder, out = Path(folder), Path(out)
    configs = {n: json.loads((folder / n / "config.json").read_text()) for n in ("transformer", "vae", "audio_vae")}
    dit = layout_for_config(configs["transformer"]).to_original(component_state(folder, "transformer"))
    vae = video_vae_table(configs["vae"]).to_original(component_state(folder, "vae"))
    audio = audio_vae_table(configs["audio_vae"]).to_original(component_state(folder, "audio_vae"))
    for state, name in ((vae, "vae"), (audio, "audio_vae")):
        channels = configs[name]["latent_channels"]
        state.update({"latents_mean": torch.zeros(channels), "latents_std": torch.ones(channels)})
    vae["decoder.mask_token"] = torch.zeros(1, 1, vae["decoder.x_embedder.weight"].shape[0])
    return {
        "diffusion_model": save({f"model.diffusion_model.{k}": v for k, v in dit.items()},
                                out / "minimax_h3_fl2va.safetensors"),
        "vae": save(vae, out / "minimax_h3_video_vae_fp16.safetensors"),
        "audio_vae": save(audio, out / "minimax_h3_audio_vae_fp32.safetensors"),
        "text_encoder": save(comfyui_qwen3vl(component_state(folder, "text_encoder")),
                             out / "qwen3vl_minimax.safetensors"),
    }


#: the linears the released pruned int8 "convrot" files quantize: each block's attention and MLP (200 in all)
PRUNED_QUANTIZED = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def pruned_file(folder: Path, out: Path, grid: int = 1025, rank: int | None = None, form: str | None = None) -> Path:
    """A tiny folder's transformer as MiniMax H3's pruned (curve-form) file, as the releases are made
    (:func:`diffpipe_minimax.pruned.curve_of`: ``adaln_t_table`` of ``grid`` rows, the AdaLN projections reduced to
    ``rank``, all of the time embedding's width by default: then exact), in the reference layout under
    ``model.diffusion_model.``; ``form = "int8_convrot"``: with the blocks' attention and MLP linears quantized as
    ComfyUI's ``int8_tensorwise`` convrot files store them, the rest as it is."""
    from diffusers import MiniMaxH3Transformer3DModel

    from diffpipe_core.testing.component_files import quantize_state, save
    from diffpipe_minimax.original import layout_for_config
    from diffpipe_minimax.pruned import curve_of

    model = MiniMaxH3Transformer3DModel.from_pretrained(str(Path(folder) / "transformer"))
    state = layout_for_config(dict(model.config)).to_original(curve_of(model, grid, rank))
    if form is not None:
        chosen = {k: v for k, v in state.items()
                  if k.startswith("blocks.") and k.rpartition(".")[0].endswith(PRUNED_QUANTIZED)}
        state.update(quantize_state(chosen, form, min_elements=1))
    return save({f"model.diffusion_model.{k}": v for k, v in state.items()}, Path(out))


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_minimax.testing FOLDER``: write a tiny MiniMax H3 folder."""
    parser = tiny.folder_parser(main.__doc__)
    print(f"wrote {write_tiny_minimax(parser.parse_args(argv).folder)}")


if __name__ == "__main__":
    main()
