"""diffusion-pipe's ``[model] type`` names and the diffpipe model each becomes.

diffusion-pipe names one type per family and picks the variant at run time: Flux Kontext is ``type = 'flux'``
with a Kontext transformer or a dataset with ``control_path``, Qwen-Image-Edit likewise ``'qwen_image'``, Wan's
image-to-video checkpoints are ``'wan'`` (their ``config.json`` says ``model_type = 'i2v'``). diffpipe names each
variant (its plugins declare what each takes), so :func:`diffpipe_model` reads what diffusion-pipe reads to choose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# every type diffusion-pipe's train.py knows (at 8f83dbf) -> the diffpipe model of the same family
MODEL_TYPES = {
    "sdxl": "sdxl",
    "flux": "flux",
    "ltx-video": "ltx-video",
    "hunyuan-video": "hunyuan-video",
    "cosmos": "cosmos",
    "wan": "wan",
    "chroma": "chroma",
    "cosmos_predict2": "cosmos-predict2",
    "qwen_image": "qwen-image",
    "z_image": "z-image",
    "sd3": "sd3",
    "auraflow": "auraflow",
    "lumina_2": "lumina2",
    "hunyuan_video_15": "hunyuan-video-1.5",
    "flux2": "flux2",
    "ltx2": "ltx-2.3",  # "Only LTX2.3 is supported" (its docs/supported_models.md); the file tells 2.0 and 2.5 apart
    "krea2": "krea2",
    "anima": "anima",
    "ideogram4": "ideogram4",
    "hidream": "hidream",
    "hunyuan_image": "hunyuan-image-2.1",
    "omnigen2": "omnigen2",
    "ernie_image": "ernie-image",
    "minimax_h3": "minimax-h3",
}

# types diffpipe has no model for yet -> the distribution that will have it (the family's, where diffpipe has one)
PLANNED: dict[str, str] = {}

# a family's model -> its edit variant (trains on control images), where the family model itself does not
EDIT_VARIANTS = {"flux": "flux-kontext", "qwen-image": "qwen-image-edit"}
# words in a model file or folder name that mark the edit variant's weights, as its releases name them
EDIT_WORDS = {"flux": "kontext", "qwen-image": "edit"}
# Wan's config.json model_type values that diffusion-pipe trains image-to-video
WAN_I2V = ("i2v",)
# what diffpipe's model reads as [model] path where diffusion-pipe took another model's folder
PATH_NOTES = {
    "qwen-image-edit": "path must be a Qwen-Image-Edit diffusers folder (its processor prepares the control images); "
    "diffusion-pipe also took Qwen-Image's folder with an edit transformer file",
    "chroma": "path must be a Chroma diffusers folder; diffusion-pipe took FLUX.1-dev's for Chroma's VAE and T5",
}
# [model] keys whose diffpipe default differs from diffusion-pipe's, per diffpipe model: written with the anchor's
# value when its config leaves the key out (value, why)
ANCHOR_DEFAULTS: dict[str, dict[str, tuple[Any, str]]] = {
    "sdxl": {"train_text_encoders": (
        True, "diffusion-pipe trains SDXL's text encoders (its text is not cached); false caches it instead")},
    "omnigen2": {"flux_shift": (
        False, "diffusion-pipe's default: no resolution shift (diffpipe's is true, as OmniGen2's own training)")},
    "minimax-h3": {
        "shift": (1.0, "diffusion-pipe's default: no shift unless shift is given (diffpipe's is 12.0, the pipeline's)"),
        "train_audio": (True, "diffusion-pipe trains the sound of every clip that has a track (diffpipe's default: "
                              "false, video only)"),
    },
}
# components diffusion-pipe reads from its diffusion_model file, per diffpipe model: written as diffpipe's component
# file keys naming that file when the anchor's [model] gives it (LTX-2's ComfyUI checkpoint holds vae.*, audio_vae.*)
CHECKPOINT_PARTS: dict[str, dict[str, str]] = {
    name: {
        "vae": "diffusion-pipe reads LTX-2's VAE from the diffusion_model checkpoint (its vae.* tensors)",
        "audio_vae": "the audio VAE from the same checkpoint (its audio_vae.* tensors; diffusion-pipe trains no sound)",
    }
    for name in ("ltx-2", "ltx-2.3", "ltx-2.5")
}
MODEL_FILE_KEYS = ("diffusers_path", "transformer_path", "ckpt_path", "diffusion_model", "checkpoint_path")


@dataclass(frozen=True)
class ModelChoice:
    """The diffpipe model for an anchor ``[model]`` table: ``name`` (None: diffpipe has none yet), why it differs
    from the family's name, for a type diffpipe lacks the distribution that will have it, and what its ``path``
    must be where diffusion-pipe took another folder (:data:`PATH_NOTES`)."""

    name: str | None
    why: str = ""
    planned: str | None = None

    @property
    def path_note(self) -> str:
        return PATH_NOTES.get(self.name or "", "")


def diffpipe_model(anchor_type: str, table: dict[str, Any], uses_control: bool, base: Path) -> ModelChoice:
    """The diffpipe model for diffusion-pipe's ``type = anchor_type`` with the rest of its ``[model]`` ``table``;
    ``uses_control``: a dataset of the run gives ``control_path`` (edit pairs); ``base``: where relative paths
    start."""
    name = MODEL_TYPES.get(anchor_type)
    if name is None:
        planned = PLANNED.get(anchor_type)
        return ModelChoice(None, planned=planned)
    edit = EDIT_VARIANTS.get(name)
    if edit is not None:
        if uses_control:
            return ModelChoice(edit, f"the dataset gives control_path (edit pairs): diffpipe's {edit!r} trains them")
        named = _file_naming(table, EDIT_WORDS[name])
        if named:
            return ModelChoice(edit, f"{named} names {edit!r} weights")
    if name == "wan":
        variant = _wan_model_type(table, base)
        if variant in WAN_I2V:
            return ModelChoice("wan-i2v", f"the checkpoint's config.json says model_type = {variant!r}: "
                                          "diffpipe's 'wan-i2v' trains it on each clip's first frame")
        if variant == "flf2v":
            return ModelChoice("wan-flf2v", "the checkpoint's config.json says model_type = 'flf2v': diffpipe's "
                                            "'wan-flf2v' trains it on each clip's first and last frame")
    if name == "ltx-2.3":
        variant = _ltx2_variant(table, base)
        if variant is not None:
            return variant
    if name == "flux2":
        named = _file_naming(table, "klein")
        if named:
            return ModelChoice("flux2-klein", f"{named} names FLUX.2 [klein] weights")
    return ModelChoice(name)


def _file_naming(table: dict[str, Any], word: str) -> str:
    """The first ``key = path`` of the table whose file or folder name contains ``word`` ("" if none)."""
    for key in MODEL_FILE_KEYS:
        value = table.get(key)
        if isinstance(value, str) and word in Path(value).name.lower():
            return f"{key} = {Path(value).name!r}"
    return ""


def _wan_model_type(table: dict[str, Any], base: Path) -> str | None:
    """``model_type`` of the Wan checkpoint folder's config.json, as diffusion-pipe reads it (None if unreadable)."""
    for key in ("ckpt_path", "transformer_path"):
        value = table.get(key)
        if not isinstance(value, str):
            continue
        folder = Path(value).expanduser()
        folder = folder if folder.is_absolute() else base / folder
        try:
            return json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            continue
    return None


def _ltx2_variant(table: dict[str, Any], base: Path) -> ModelChoice | None:
    """diffusion-pipe's ``ltx2`` trains LTX-2.3 (ComfyUI's ``LTXAVModel`` reads every LTX-2 checkpoint); the
    ``diffusion_model`` file says which LTX-2 it is: LTX-2.3 has the prompt adaLN (``prompt_adaln_single``,
    diffusers' ``prompt_adaln``), LTX-2.5 the prompt scale-shift tables without it, LTX-2.0 neither. A file that is
    not here is told by its name (``ltx-2-19b-*``: 2.0, ``ltx-2.5*``: 2.5). None: LTX-2.3."""
    import re

    from diffpipe_core.model_files import safetensors_header

    value = table.get("diffusion_model")
    if not isinstance(value, str):
        return None
    file = Path(value).expanduser()
    header, _, _ = safetensors_header(file if file.is_absolute() else base / file)
    if header is not None and any("transformer_blocks." in k for k in header):
        if any("prompt_adaln" in k for k in header):
            return None
        if any("prompt_scale_shift_table" in k for k in header):
            return ModelChoice("ltx-2.5", f"{file.name} has prompt scale-shift tables without a prompt adaLN: "
                                          "an LTX-2.5 transformer (diffusion-pipe names LTX-2.3 only)")
        return ModelChoice("ltx-2", f"{file.name} has no prompt modulation: an LTX-2.0 transformer (diffusion-pipe "
                                    "supports LTX-2.3 only)")
    if header is None and re.search(r"ltx-?2[._]5", file.name.lower()):
        return ModelChoice("ltx-2.5", f"diffusion_model = {file.name!r} names LTX-2.5 weights")
    if header is None and re.search(r"ltx-?2-\d+b", file.name.lower()):
        return ModelChoice("ltx-2", f"diffusion_model = {file.name!r} names LTX-2.0 weights (diffusion-pipe "
                                    "supports LTX-2.3 only)")
    return None
