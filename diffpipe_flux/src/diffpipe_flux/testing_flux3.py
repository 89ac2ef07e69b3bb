"""Write a tiny random-weight FLUX.3 to disk in its real layouts, for tests and benchmarks.

:func:`write_tiny_flux3` saves a diffusers FLUX.3 folder as the modular pipeline's components: ``model_index.json``
(``Flux3ModularPipeline``, or ``Flux3DistilledModularPipeline`` for the step-distilled flow map), ``transformer/``
(``Flux3Transformer2DModel``), ``vae/`` (FLUX.2's ``AutoencoderKLFlux2`` with random batch-norm statistics),
``text_encoder/`` (the core's tiny ``Qwen3VLForConditionalGeneration`` of 32 layers, so the pipeline's taps 4, 8, ...,
32 exist), ``tokenizer/`` (its ``Qwen3VLProcessor``: image processor, tokenizer, chat template), ``scheduler/``
(FLUX.3's constant shift 6.93); and beside it the transformer as one file in BFL's layout under
``model.diffusion_model.`` (:func:`bfl_path`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.parts.vl_processors import save_processor
from diffpipe_core.testing import tiny

#: the modular pipeline's scheduler shift (``Flux3SetTimestepsStep``)
SHIFT = 6.93
TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class TinyFlux3Config(tiny.TinySizes):
    """Sizes of the tiny FLUX.3: 1 mode block per mode and 2 joint blocks of 2 heads of 16 (rotary axes 4 x 4), 4 VAE
    channels (16 after the 2x2 patches), a 32-layer Qwen3-VL of width ``text_dim`` (8 taps stacked: the transformer's
    ``joint_attention_dim``). ``flow_map``: the step-distilled checkpoint."""

    num_layers: int = 1
    num_single_layers: int = 2
    axes_dims_rope: tuple[int, ...] = (4, 4, 4, 4)
    text_layers: int = 32
    vae_channels: tuple[int, ...] = field(default=(8, 8, 8, 8))
    flow_map: bool = False


def processor() -> Any:
    """A Qwen3-VL processor (:func:`~diffpipe_core.testing.tiny.qwen3_vl_processor`) whose tokenizer is trained on
    the chat template of a caption."""
    return tiny.qwen3_vl_processor([TEMPLATE.format("a photo of a red cat")])


def tiny_transformer(cfg: TinyFlux3Config) -> Any:
    """The random-weight diffusers ``Flux3Transformer2DModel`` of ``cfg`` (its QK norms given non-trivial weights)."""
    from diffusers import Flux3Transformer2DModel

    torch.manual_seed(cfg.seed)
    model = Flux3Transformer2DModel(
        in_channels=4 * cfg.latent_channels, cond_in_channels=4 * cfg.latent_channels, num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, joint_attention_dim=8 * cfg.text_dim, timestep_channels=32,
        axes_dims_rope=tuple(cfg.axes_dims_rope), flow_map=cfg.flow_map,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".norm_" in name:
                param.uniform_(0.5, 1.5)
    return model


def parts(cfg: TinyFlux3Config) -> dict[str, tiny.Part]:
    """The FLUX.3 components of ``cfg``, in build order."""
    from diffpipe_flux.testing import tiny_flux2_vae

    proc = processor()
    return {
        "transformer": tiny.Part(lambda: tiny_transformer(cfg)),
        "vae": tiny.Part(lambda: tiny_flux2_vae(cfg), seed=cfg.seed + 1),  # type: ignore[arg-type]
        "text_encoder": tiny.Part(lambda: tiny.qwen3_vl(proc.tokenizer, cfg.text_dim, cfg.text_layers),
                                  seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: proc),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=SHIFT)),
    }


def bfl_path(folder: Path) -> Path:
    """Where :func:`write_tiny_flux3` puts the BFL-layout single file of ``folder``'s transformer."""
    return tiny.beside(folder, "-bfl.safetensors")


def pipeline_class(distilled: bool) -> str:
    return "Flux3DistilledModularPipeline" if distilled else "Flux3ModularPipeline"


def write_tiny_flux3(folder: Path, cfg: TinyFlux3Config | None = None, distilled: bool = False) -> Path:
    """A tiny FLUX.3 folder (``distilled``: a flow-map transformer, ``Flux3DistilledModularPipeline``) and its
    BFL-layout transformer file beside it (:func:`bfl_path`)."""
    from diffpipe_flux.flux3_keys import layout_for_config

    cfg = cfg or TinyFlux3Config(flow_map=distilled)
    folder = Path(folder)
    built = tiny.build_components(parts(cfg))
    proc = built.pop("tokenizer")  # it does not save itself without torchvision: saved below, part by part
    tiny.write_folder(pipeline_class(cfg.flow_map), {k: tiny.Part(lambda v=v: v) for k, v in built.items()}, folder)
    save_processor(proc, folder / "tokenizer")
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "Qwen3VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    state = layout_for_config(dict(built["transformer"].config)).to_original(built["transformer"].state_dict())
    tiny.save_single_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, bfl_path(folder))
    return folder


def write_tiny_flux3_distilled(folder: Path) -> Path:
    """A tiny step-distilled FLUX.3 folder (:func:`write_tiny_flux3` with ``distilled``)."""
    return write_tiny_flux3(folder, distilled=True)


def load_components(folder: Path) -> dict[str, Any]:
    """The components of a tiny folder (float32), the processor loaded without torchvision."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux3Transformer2DModel
    from transformers import Qwen3VLForConditionalGeneration

    from diffpipe_core.parts.vl_processors import ImageOnlyQwen3VLProcessor, load_processor

    folder = Path(folder)
    return {
        "transformer": Flux3Transformer2DModel.from_pretrained(str(folder / "transformer")),
        "vae": AutoencoderKLFlux2.from_pretrained(str(folder / "vae")),
        "text_encoder": Qwen3VLForConditionalGeneration.from_pretrained(str(folder / "text_encoder")).eval(),
        "tokenizer": load_processor(folder / "tokenizer", ImageOnlyQwen3VLProcessor),
        "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler")),
    }


def modular_pipeline(folder: Path, distilled: bool = False) -> Any:
    """The FLUX.3 modular pipeline (``Flux3AutoBlocks``, or ``Flux3DistilledAutoBlocks``) over a tiny folder's
    components, without the prompt upsampler (prompts encoded as given, as captions are)."""
    from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks

    blocks = (Flux3DistilledAutoBlocks if distilled else Flux3AutoBlocks)()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline()
    pipe.update_components(**load_components(folder))
    return pipe


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_flux.testing_flux3 FOLDER``: write a tiny FLUX.3 (the folder and
    ``FOLDER-bfl.safetensors``, the transformer in BFL's layout)."""
    parser = tiny.folder_parser(main.__doc__)
    folder = write_tiny_flux3(parser.parse_args(argv).folder)
    print(f"wrote {folder} and {bfl_path(folder)}")


if __name__ == "__main__":
    main()
