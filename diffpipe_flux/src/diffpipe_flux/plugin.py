"""The Flux model plugin (entry point ``flux``): Flux.1 dev and schnell on the core's shared plugin parts.

No torch import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, present, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_core.parts.targets import JOINT_ATTENTION
from diffpipe_flux.config import FluxConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

ATTENTION_AND_MLP = [
    *JOINT_ATTENTION,
    *("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"),
]
PIPELINES = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline", "FluxControlPipeline")
COMPONENTS = {
    "transformer": "FluxTransformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": "CLIPTextModel",
    "text_encoder_2": "T5EncoderModel",
    "tokenizer": TOKENIZER,
    "tokenizer_2": TOKENIZER,
}
DEFAULT_GUIDANCE = 3.5  # FluxPipeline's guidance_scale default
IMG_IN = weight_of("img_in", "x_embedder")
#: a Flux-like file's block counts and widths (BFL's or diffusers' names), for Flux.1, Chroma and FLUX.2
FLUX_FILE_CONFIG = {
    "num_layers": blocks("double_blocks", "transformer_blocks"),
    "num_single_layers": blocks("single_blocks", "single_transformer_blocks"),
    "num_attention_heads": Shape(IMG_IN, 0, per="attention_head_dim"),
    "in_channels": Shape(IMG_IN, 1),
    "joint_attention_dim": Shape(weight_of("txt_in", "context_embedder"), 1),
}


class Flux(DiffusersModel, FlowSampling):
    """Flux.1: an image model; VAE factor 8 x 2x2 packing = sizes in multiples of 16 pixels."""
    tiny_writer = "diffpipe_flux.testing:write_tiny_flux"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "flux", FluxConfig, "Flux.1 dev/schnell (diffusers folder or BFL single-file transformer)",
        encoder_settings=("t5_max_length",), block_layers=("DoubleBlockLayer", "SingleBlockLayer"),
    )
    folder = DiffusersFolder(
        "flux", (*PIPELINES, "FluxKontextPipeline"), COMPONENTS, single_file_example="flux1-dev.safetensors"
    )
    model_class = "FluxTransformer2DModel"
    encoder_components = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")  # CLIP-L, then T5
    comfy_takes_diffusers_names = True
    single_file_markers = ("double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight")
    file_config = {  # dev or schnell (or Fill's 384 input channels), and the block counts, from the file itself
        **FLUX_FILE_CONFIG,
        "guidance_embeds": present("guidance_in", "time_text_embed.guidance_embedder"),
    }
    single_file_name = "flux1-transformer.safetensors"
    key_tables = "diffpipe_flux.bfl"
    #: the released size (FLUX.1 [dev], 11.9 B) for the model page's GPU-fit table (diffpipe_core.engine.fit_table)
    plan_size = {
        "transformer": {"in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                        "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
                        "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]},
        "vae": {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512]},
        "text": {"t5_embeds": (512, 4096), "clip_pooled": (768,)},
    }  # fmt: skip

    def default_lora_targets(self, model_config: FluxConfig) -> list[str]:
        """Attention and MLP linears of the double and single blocks. A single block's output linear is named
        ``proj_out`` like the model's final projection, so those are listed by full name."""
        n_single = int(self.model_folder_config(model_config).get("num_single_layers", 0))
        return ATTENTION_AND_MLP + [f"single_transformer_blocks.{i}.proj_out" for i in range(n_single)]

    # ------------------------------------------------------------------------------------------ caching

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, H/8, W/8) as ``(mode - shift_factor) * scaling_factor``, ``mask`` on the latent
        grid. Captions: ``t5_embeds`` (B, t5_max_length, d) and ``clip_pooled`` (B, d), as
        ``FluxPipeline.encode_prompt`` makes them."""
        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out.update(self.encode_media(encoders, batch))
        if batch.captions is not None:
            out.update(self.encode_captions(encoders, batch.captions))
        return out

    def encode_media(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """``latents`` normalised as the VAE's config says and, with masks, ``mask`` on the latent grid."""
        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode

        out = {"latents": shift_and_scale(vae_mode(encoders.vae, batch.pixels), encoders.vae.config).cpu()}
        if batch.masks is not None:
            out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        return out

    def encode_captions(self, encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        from diffpipe_core.parts.text import TextEncoding, encode_text

        clip_len = min(encoders.tokenizer.model_max_length, encoders.text_encoder.config.max_position_embeddings)
        clip = encode_text(
            encoders.text_encoder, encoders.tokenizer, captions, TextEncoding(clip_len, pooled="pooler_output")
        )
        t5 = encode_text(
            encoders.text_encoder_2, encoders.tokenizer_2, captions, TextEncoding(encoders.config.t5_max_length)
        )
        return {"t5_embeds": t5.embeds, "clip_pooled": clip.pooled}

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: FluxConfig) -> list[nn.Module]:
        """Embedders, each double block, each single block, final norm/projection."""
        from diffpipe_flux import layers

        return layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, t5_embeds, clip_pooled, guidance, img_ids, txt_ids), (target[, mask]))``, packed 2x2; rectified
        flow (:func:`diffpipe_core.parts.flow.flow_sample`) with ``shift`` or Flux's resolution shift."""
        import torch

        from diffpipe_flux.packing import image_ids, pack, text_ids

        cfg: FluxConfig = context.model_config  # type: ignore[assignment]
        f, targets = self.packed_flow(batch, context, generator)
        b, _, h, w = f.x_t.shape
        text = batch["t5_embeds"].float()
        guidance = torch.full((b,), float(cfg.guidance))
        inputs = (
            pack(f.x_t),
            f.t,
            text,
            batch["clip_pooled"].float(),
            guidance,
            image_ids(h, w),
            text_ids(text.shape[1]),
        )
        return inputs, targets

    def packed_flow(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """The flow sample of ``batch["latents"]`` (``shift``, or Flux's resolution shift with ``flux_shift``) and its
        packed targets: ``(velocity[, mask])``."""
        from diffpipe_core.diffusion import flux_resolution_shift
        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_flux.packing import pack

        cfg = context.model_config
        b, c, h, w = batch["latents"].shape
        shift = flux_resolution_shift((h // 2) * (w // 2)) if cfg.flux_shift else cfg.shift  # type: ignore[attr-defined]
        f = flow_sample(batch["latents"], cfg, context, generator, shift)  # type: ignore[arg-type]
        return f, with_mask((pack(f.target),), batch, lambda m: pack(m.expand(b, c, h, w).contiguous()))

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: FluxConfig, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` and ``FluxPipeline``'s resolution-shifted flow-matching sigmas."""
        from diffpipe_flux import sampling

        return sampling.denoise_init(self.folder, request, model_config, generator)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """Packed latents, t, T5 and CLIP embeddings, guidance (``[sample] guidance``, default 3.5), position ids."""
        import torch

        from diffpipe_flux.packing import image_ids, pack, text_ids

        b, _, h, w = latents.shape
        guidance = DEFAULT_GUIDANCE if request.guidance is None else request.guidance
        t5 = text["t5_embeds"].float()
        t = schedule[index].float().expand(b)
        pooled = text["clip_pooled"].float()
        return (
            pack(latents.float()),
            t,
            t5,
            pooled,
            torch.full((b,), float(guidance)),
            image_ids(h, w),
            text_ids(t5.shape[1]),
        )

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        from diffpipe_flux.packing import unpack

        return unpack(prediction, latents.shape[-2], latents.shape[-1])


plugin = Flux()
