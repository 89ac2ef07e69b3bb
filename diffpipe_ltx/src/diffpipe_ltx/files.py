"""``validate_model_files`` for LTX-Video: the folder's and single file's structure, without reading any weights
(no torch import either)."""

from __future__ import annotations

from pathlib import Path

from diffpipe_core.model_files import TOKENIZER, check_diffusers_folder, read_json, safetensors_keys
from diffpipe_ltx.config import LTXConfig

PIPELINES = ("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline")
COMPONENTS = {
    "transformer": ("LTXVideoTransformer3DModel",),
    "vae": ("AutoencoderKLLTXVideo",),
    "text_encoder": ("T5EncoderModel",),
    "tokenizer": (TOKENIZER,),
}
# Every original-layout LTX-Video transformer has the patch projection under its original name.
ORIGINAL_MARKER = "patchify_proj.weight"


def problems(cfg: LTXConfig) -> list[str]:
    """Problems with ``path`` (a diffusers LTX-Video folder) and ``transformer_file`` (an original single file)."""
    found = check_diffusers_folder(cfg.path, PIPELINES, COMPONENTS, "ltx-video")
    if found:
        return found
    found = _sizes(cfg.path)
    if cfg.transformer_file is not None:
        return found + _single_file(cfg.transformer_file)
    folder = cfg.path / "transformer"
    single = folder / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        _, problem = safetensors_keys(single)
        return found + ([f"{problem}; expected the LTX-Video transformer's weights"] if problem else [])
    if not (folder / "diffusion_pytorch_model.safetensors.index.json").is_file():
        found.append(
            f"{folder}: no diffusion_pytorch_model.safetensors (or .index.json); expected the LTX-Video transformer's "
            "weights, or give transformer_file for an original-layout single file"
        )
    return found


def _single_file(file: Path) -> list[str]:
    keys, problem = safetensors_keys(file)
    if problem:
        return [f"{problem}; expected an original-layout LTX-Video checkpoint (ltx-video-2b-v0.9.safetensors)"]
    if not any(k == ORIGINAL_MARKER or k.endswith("." + ORIGINAL_MARKER) for k in keys):
        hint = (
            " (this looks like a diffusers-layout file: put it in path/transformer/)"
            if "proj_in.weight" in keys
            else ""
        )
        return [
            f"{file}: no {ORIGINAL_MARKER!r} among its {len(keys)} keys (e.g. {', '.join(keys[:3])}); expected an "
            f"original-layout LTX-Video transformer{hint}"
        ]
    return []


def _sizes(folder: Path) -> list[str]:
    """The components must fit together: T5 width = the transformer's caption_channels, VAE latent channels =
    the transformer's in_channels."""
    transformer, _ = read_json(folder / "transformer" / "config.json")
    vae, _ = read_json(folder / "vae" / "config.json")
    t5, _ = read_json(folder / "text_encoder" / "config.json")
    found = []
    pairs = (
        (t5, "d_model", "text_encoder", "caption_channels", 4096),
        (vae, "latent_channels", "vae", "in_channels", 128),
    )
    for other, key, name, tkey, default in pairs:
        if transformer is None or other is None or key not in other:
            continue
        if other[key] != transformer.get(tkey, default):
            found.append(
                f"{folder / name / 'config.json'}: {key} is {other[key]}, but {folder / 'transformer' / 'config.json'} "
                f"has {tkey} {transformer.get(tkey, default)}; the components are from different models"
            )
    return found
