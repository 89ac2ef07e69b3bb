"""``validate_model_files`` for both Cosmos entry points: the folder's structure, checked without reading weights."""

from __future__ import annotations

from diffpipe_core.model_files import TOKENIZER, check_diffusers_folder, safetensors_keys
from diffpipe_cosmos.config import CosmosConfigBase
from diffpipe_cosmos.original import Variant, detect_variant

PIPELINES: dict[str, tuple[str, ...]] = {
    "1.0": ("CosmosTextToWorldPipeline", "CosmosVideoToWorldPipeline"),
    "predict2": ("Cosmos2TextToImagePipeline", "Cosmos2VideoToWorldPipeline"),
}
VAES = {"1.0": ("AutoencoderKLCosmos",), "predict2": ("AutoencoderKLWan",)}
NAMES = {"1.0": "cosmos", "predict2": "cosmos-predict2"}


def problems(cfg: CosmosConfigBase, variant: Variant) -> list[str]:
    """Problems with ``path`` (a diffusers Cosmos folder of this generation) and ``transformer_file`` (an original
    NVIDIA single file of the same generation)."""
    components = {
        "transformer": ("CosmosTransformer3DModel",),
        "vae": VAES[variant],
        "text_encoder": ("T5EncoderModel",),
        "tokenizer": (TOKENIZER,),
    }
    found = check_diffusers_folder(cfg.path, PIPELINES[variant], components, NAMES[variant])
    if found:
        return found
    if cfg.transformer_file is not None:
        keys, problem = safetensors_keys(cfg.transformer_file)
        if problem:
            return [f"{problem}; expected a Cosmos {variant} transformer in NVIDIA's layout"]
        kind = detect_variant(keys)
        if kind != variant:
            what = f"a Cosmos {kind} transformer" if kind else f"no net.blocks.* tensors among its {len(keys)} keys"
            return [
                f"{cfg.transformer_file}: {what} (e.g. {', '.join(keys[:3])}); expected a Cosmos {variant} "
                "transformer in NVIDIA's layout"
            ]
        return []
    folder = cfg.path / "transformer"
    single = folder / "diffusion_pytorch_model.safetensors"
    if not single.is_file() and not (folder / "diffusion_pytorch_model.safetensors.index.json").is_file():
        return [
            f"{folder}: no diffusion_pytorch_model.safetensors (or .index.json); expected the Cosmos transformer's "
            "weights, or give transformer_file for an original single-file checkpoint"
        ]
    if single.is_file():
        _, problem = safetensors_keys(single)
        if problem:
            return [f"{problem}; expected the Cosmos transformer's weights"]
    return []
