"""``validate_model_files`` for HunyuanVideo: the folder's and the single file's structure, read without
loading any weights (``model_index.json`` / ``config.json`` class names, components, safetensors headers)."""

from __future__ import annotations

from diffpipe_core.model_files import TOKENIZER, check_diffusers_folder, safetensors_keys
from diffpipe_hunyuan.config import HunyuanConfig
from diffpipe_hunyuan.original import strip_prefix

PIPELINES = ("HunyuanVideoPipeline",)
COMPONENTS = {
    "transformer": ("HunyuanVideoTransformer3DModel",),
    "vae": ("AutoencoderKLHunyuanVideo",),
    "text_encoder": ("LlamaModel", "LlamaForCausalLM"),
    "text_encoder_2": ("CLIPTextModel",),
    "tokenizer": (TOKENIZER,),
    "tokenizer_2": (TOKENIZER,),
}
# An original-layout transformer holds these modules (the qkv name tells it from ComfyUI's or diffusers' names).
ORIGINAL_MARKERS = ("double_blocks.0.img_attn_qkv.weight", "single_blocks.0.linear1.weight")
WEIGHTS = "diffusion_pytorch_model.safetensors"


def problems(cfg: HunyuanConfig) -> list[str]:
    """Problems with ``path`` (a diffusers HunyuanVideo folder) and ``transformer_file`` (an original-layout
    single file); ``[]`` when both fit."""
    found = check_diffusers_folder(cfg.path, PIPELINES, COMPONENTS, "hunyuan-video")
    if found:
        return found
    if cfg.transformer_file is not None:
        keys, problem = safetensors_keys(cfg.transformer_file)
        if problem:
            return [f"{problem}; expected a HunyuanVideo transformer in the original (Tencent) key layout"]
        names = {strip_prefix(k) for k in keys}
        absent = [m for m in ORIGINAL_MARKERS if m not in names]
        if absent:
            return [
                f"{cfg.transformer_file}: no {absent[0]!r} among its {len(keys)} keys (e.g. {', '.join(keys[:3])}); "
                "expected a HunyuanVideo transformer in the original (Tencent) key layout"
            ]
        return []
    folder = cfg.path / "transformer"
    if (folder / f"{WEIGHTS}.index.json").is_file():
        return []
    _, problem = safetensors_keys(folder / WEIGHTS)
    if problem:
        return [f"{problem}; expected the HunyuanVideo transformer's weights (or give transformer_file)"]
    return []
