"""LTX-2.3 (entry point ``ltx-2.3``) and LTX-2.5 (``ltx-2.5``): the LTX-2 plugin (:mod:`diffpipe_ltx.ltx2`) on the
LTX-2.3 layout of diffusers' ``LTX2VideoTransformer3DModel``.

What differs from LTX-2.0, all of it in the model's config and handled by the shared layers
(:mod:`diffpipe_ltx.ltx2_layers`):

- ``cross_attn_mod`` / ``audio_cross_attn_mod``: each block's ``scale_shift_table`` has 9 rows (the extra 3 modulate
  the text cross-attention's query) and the block has ``prompt_scale_shift_table`` / ``audio_prompt_scale_shift_table``
  for the text keys and values, modulated by the model's ``prompt_adaln`` / ``audio_prompt_adaln`` of the sample's
  time (LTX-2.3) or static (LTX-2.5, ``use_prompt_adaln_single = false``);
- ``use_prompt_embeddings = false``: no caption projection; the text connectors project Gemma's hidden states per
  stream (``per_modality_projections``: ``video_text_proj_in`` / ``audio_text_proj_in``), so the cached
  ``video_text`` / ``audio_text`` have each stream's width (the connectors' ``video_hidden_dim`` /
  ``audio_hidden_dim``);
- ``gated_attn`` / ``audio_gated_attn``: each attention's ``to_gate_logits`` (a LoRA target only when named in
  ``[adapter] target_modules``, as the anchor leaves it out).

LTX-2.5's folder is an ``LTX25ModularPipeline`` folder (``modular_model_index.json``, read by the core's
:func:`diffpipe_core.model_files.pipeline_index`); it trains as LTX-2.3 and its samples are decoded with the
convolutional VAE the folder keeps (not the diffusion decoder). This module imports no torch, diffusers or
transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffpipe_core.parts.folder import SizeMatch
from diffpipe_ltx.config import LTX23Config, LTX25Config
from diffpipe_ltx.lightricks_vae import ltx2_audio_vae_table, ltx2_vae_table
from diffpipe_ltx.ltx2 import COMPONENTS, LTX2, LTX2Folder, is_ltx23, ltx2_spec

#: the connectors' per-stream widths are the transformer's text cross-attention widths (LTX-2.3's 4096 and 2048)
SIZES = (
    SizeMatch("connectors", "video_hidden_dim", "cross_attention_dim", 4096),
    SizeMatch("connectors", "audio_hidden_dim", "audio_cross_attention_dim", 2048),
    SizeMatch("vae", "latent_channels", "in_channels", 128),
)


#: LTX-2.5's text encoder is Gemma 4 (diffusers' ``resolve_default_image_crf``: ``gemma4`` / ``gemma4_unified``); the
#: folder's index names which one is built (``DiffusersFolder.component_class``)
GEMMA4 = ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration", "Gemma3ForConditionalGeneration")


def _folder(name: str, pipelines: tuple[str, ...], example: str, components: dict[str, Any] = COMPONENTS
            ) -> LTX2Folder:
    return LTX2Folder(
        name, pipelines, components, sizes=SIZES, single_file_example=example, by_index=("text_encoder",),
        file_layouts={"vae": ltx2_vae_table, "audio_vae": ltx2_audio_vae_table},
        file_optional={"text_encoder": ("model.vision_tower.", "model.multi_modal_projector.")},
    )


class LTX23(LTX2):
    """LTX-2.3: LTX-2 (video and audio, first-frame conditioning) on the LTX-2.3 transformer layout."""

    tiny_writer = "diffpipe_ltx.ltx2_testing:write_tiny_ltx23"
    spec = ltx2_spec("ltx-2.3", LTX23Config, "LTX-2.3 video and audio (diffusers LTX2Pipeline folder or original "
                     "Lightricks single-file transformer)")
    folder = _folder("ltx-2.3", ("LTX2Pipeline", "LTX2ImageToVideoPipeline"), "ltx-2.3-22b-dev.safetensors")

    def check_layout(self, config: dict[str, Any], file: Path) -> None:
        """``ltx-2.3`` trains transformers with LTX-2.3's layout; an LTX-2.0 one is refused, naming ``ltx-2``."""
        if not is_ltx23(config):
            raise ValueError(
                f"{file}: an LTX-2.0 transformer (no cross_attn_mod, a caption projection); {self.spec.name} trains "
                "LTX-2.3-style transformers: use [model] type = \"ltx-2\""
            )
        if config.get("use_prompt_embeddings", True):
            raise ValueError(
                f"{file}: use_prompt_embeddings = true with cross_attn_mod; {self.spec.name} expects LTX-2.3's "
                "per-stream connector projections (use_prompt_embeddings = false)"
            )


class LTX25(LTX23):
    """LTX-2.5: LTX-2.3's training from an ``LTX25ModularPipeline`` folder."""

    tiny_writer = "diffpipe_ltx.ltx2_testing:write_tiny_ltx25"
    spec = ltx2_spec("ltx-2.5", LTX25Config, "LTX-2.5 video and audio (diffusers LTX25ModularPipeline folder or "
                     "original Lightricks single-file transformer)")
    folder = _folder("ltx-2.5", ("LTX25ModularPipeline",), "ltx-2.5.safetensors",
                     {**COMPONENTS, "text_encoder": GEMMA4})


ltx23 = LTX23()
ltx25 = LTX25()
