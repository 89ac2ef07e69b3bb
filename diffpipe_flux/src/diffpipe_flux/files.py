"""``validate_model_files`` for Flux: the folder's structure, checked without reading any weights."""

from __future__ import annotations

from diffpipe_core.model_files import TOKENIZER, check_diffusers_folder, safetensors_keys
from diffpipe_flux.config import FluxConfig

PIPELINES = (
    "FluxPipeline",
    "FluxImg2ImgPipeline",
    "FluxInpaintPipeline",
    "FluxFillPipeline",
    "FluxControlPipeline",
    "FluxKontextPipeline",
)
COMPONENTS = {
    "transformer": ("FluxTransformer2DModel",),
    "vae": ("AutoencoderKL",),
    "text_encoder": ("CLIPTextModel",),
    "text_encoder_2": ("T5EncoderModel",),
    "tokenizer": (TOKENIZER,),
    "tokenizer_2": (TOKENIZER,),
}
# A BFL-layout transformer file holds these blocks (under an optional model.diffusion_model. prefix).
BFL_MARKERS = ("double_blocks.0.", "single_blocks.0.")


def problems(cfg: FluxConfig) -> list[str]:
    """Problems with ``path`` (a diffusers Flux folder) and ``transformer_file`` (a BFL single file)."""
    found = check_diffusers_folder(cfg.path, PIPELINES, COMPONENTS, "flux")
    if found:
        return found
    if cfg.transformer_file is not None:
        keys, problem = safetensors_keys(cfg.transformer_file)
        if problem:
            return [f"{problem}; expected a BFL-layout Flux transformer (flux1-dev.safetensors)"]
        if not all(any(m in k for k in keys) for m in BFL_MARKERS):
            return [
                f"{cfg.transformer_file}: no double_blocks.* / single_blocks.* tensors among its {len(keys)} keys "
                f"(e.g. {', '.join(keys[:3])}); expected a BFL-layout Flux transformer"
            ]
        return []
    folder = cfg.path / "transformer"
    single = folder / "diffusion_pytorch_model.safetensors"
    if not single.is_file() and not (folder / "diffusion_pytorch_model.safetensors.index.json").is_file():
        return [f"{folder}: no diffusion_pytorch_model.safetensors (or .index.json); expected the Flux transformer's "
                "weights, or give transformer_file for a BFL single-file checkpoint"]
    if single.is_file():
        _, problem = safetensors_keys(single)
        if problem:
            return [f"{problem}; expected the Flux transformer's weights"]
    return []
