"""Chroma (entry point ``chroma``): lodestones' Flux.1-schnell derivative, as ``ChromaPipeline`` runs it.

Chroma keeps Flux's VAE, 2x2 packing, position ids, schedule and double/single blocks, drops CLIP (T5 alone, run with
its attention mask) and the guidance and pooled-text embeddings, and computes every block's modulation in one
``distilled_guidance_layer`` from the timestep. The transformer sees each caption's tokens and its first padding
token (``ChromaPipeline``'s mask). Everything Flux's plugin does alike is Flux's (:class:`~diffpipe_flux.plugin.Flux`).
This module imports no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_flux.config import ChromaConfig
from diffpipe_flux.plugin import FLUX_FILE_CONFIG, Flux

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import TrainingContext

COMPONENTS = {
    "transformer": "ChromaTransformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": "T5EncoderModel",
    "tokenizer": TOKENIZER,
}


class Chroma(Flux):
    """Chroma: Flux's image geometry (multiples of 16 pixels) on a T5-only, modulation-approximator transformer."""
    #: the released size (Chroma1-HD, 8.9 B) for the model page's GPU-fit table (diffpipe_core.engine.fit_table):
    #: diffusers' ChromaTransformer2DModel defaults, which are lodestones/Chroma1-HD's transformer/config.json; the VAE
    #: is FLUX.1's; T5-XXL (4096 wide) at t5_max_length's default 512, with its mask
    plan_size = {
        "transformer": {"in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                        "num_attention_heads": 24, "joint_attention_dim": 4096, "axes_dims_rope": [16, 56, 56],
                        "approximator_num_channels": 64, "approximator_hidden_dim": 5120, "approximator_layers": 5},
        "vae": {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512]},
        "text": {"t5_embeds": (512, 4096), "t5_mask": (512,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_flux.testing:write_tiny_chroma"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        Flux.spec,
        name="chroma",
        config_schema=ChromaConfig,
        block_layers=("ChromaDoubleBlockLayer", "ChromaSingleBlockLayer"),
        description="Chroma (diffusers ChromaPipeline folder or Chroma's original single-file checkpoint)",
    )
    folder = DiffusersFolder(
        "chroma",
        ("ChromaPipeline", "ChromaImg2ImgPipeline", "ChromaInpaintPipeline"),
        COMPONENTS,
        single_file_example="Chroma1-HD.safetensors",
    )
    model_class = "ChromaTransformer2DModel"
    encoder_components = ("vae", "text_encoder", "tokenizer")  # T5 only
    single_file_markers = ("distilled_guidance_layer.in_proj.weight", "double_blocks.0.img_attn.qkv.weight")
    file_config = {
        **FLUX_FILE_CONFIG,
        "approximator_layers": blocks("distilled_guidance_layer.layers"),
        "approximator_hidden_dim": Shape(weight_of("distilled_guidance_layer.in_proj"), 0),
    }
    single_file_name = "chroma-transformer.safetensors"
    key_tables = "diffpipe_flux.chroma_keys"

    # ------------------------------------------------------------------------------------------ caching
    def encode_captions(self, encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """``t5_embeds`` (B, t5_max_length, d) from T5 run with the attention mask, and ``t5_mask`` (B, t5_max_length)
        keeping each caption's tokens and its first padding token, as ``ChromaPipeline.encode_prompt`` makes them."""
        import torch

        from diffpipe_core.parts.text import TextEncoding, encode_text

        settings = TextEncoding(encoders.config.t5_max_length, use_mask=True)
        t5 = encode_text(encoders.text_encoder, encoders.tokenizer, captions, settings)
        lengths = t5.mask.sum(dim=1, keepdim=True)
        return {"t5_embeds": t5.embeds, "t5_mask": (torch.arange(t5.mask.shape[1]) <= lengths).long()}

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: ChromaConfig) -> list[nn.Module]:
        """Embedders and the modulation approximator, each double block, each single block, final norm/projection."""
        from diffpipe_flux import chroma_layers

        return chroma_layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, t5_embeds, t5_mask, img_ids, txt_ids), (target[, mask]))``, packed 2x2 as Flux's."""
        from diffpipe_flux.packing import image_ids, pack, text_ids

        f, targets = self.packed_flow(batch, context, generator)
        text = batch["t5_embeds"].float()
        h, w = f.x_t.shape[-2:]
        return (pack(f.x_t), f.t, text, batch["t5_mask"].long(), image_ids(h, w), text_ids(text.shape[1])), targets

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """Packed latents, t, the T5 embeddings and mask, position ids (``[sample] cfg`` is Chroma's guidance)."""
        from diffpipe_flux.packing import image_ids, pack, text_ids

        b, _, h, w = latents.shape
        t5 = text["t5_embeds"].float()
        t = schedule[index].float().expand(b)
        return pack(latents.float()), t, t5, text["t5_mask"].long(), image_ids(h, w), text_ids(t5.shape[1])


plugin = Chroma()
