"""The LTX-Video model plugin (entry point ``ltx-video``) on the core's shared plugin parts.

``prepare_inputs`` gives the first pipeline layer ``(x_t, t, t5_embeds, t5_mask, grid)``: the packed noisy latents
``(B, F*H*W, C)``, each latent frame's flow time ``(B, F)`` (the transformer sees ``1000 t``; a first frame kept clean
by ``first_frame_conditioning_p`` has ``t = 0``), the T5 embeddings and bool mask, and the latent ``(F, H, W)`` for the
rotary embedding; the loss targets are the packed velocity and a weight that is 0 on conditioned first frames (times
the dataset's loss mask). This module imports no torch, diffusers or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.lightricks_vae import vae_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

PIPELINES = ("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline")
COMPONENTS = {
    "transformer": "LTXVideoTransformer3DModel",
    "vae": "AutoencoderKLLTXVideo",
    "text_encoder": "T5EncoderModel",
    "tokenizer": TOKENIZER,
}
SIZES = (
    SizeMatch("text_encoder", "d_model", "caption_channels", 4096),
    SizeMatch("vae", "latent_channels", "in_channels", 128),
)


class LTXVideo(DiffusersModel, FlowSampling):
    """LTX-Video: a video (and image) model; VAE 32x spatial (patch 1), 8x temporal: frames 8k + 1 at 25 fps."""
    #: the released size (LTX-Video 2B, 0.9.x) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: diffusers' LTXVideoTransformer3DModel defaults, which are Lightricks/LTX-Video's transformer/config.json; its
    #: VAE (128 channels, 32x32x8); T5-XXL (4096) at t5_max_length's default 128
    plan_size = {
        "transformer": {"in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1,
                        "num_attention_heads": 32, "attention_head_dim": 64, "cross_attention_dim": 2048,
                        "num_layers": 28,
                        "caption_channels": 4096},
        "vae": {"latent_channels": 128, "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
                "patch_size": 4, "patch_size_t": 1},
        "text": {"t5_embeds": (128, 4096), "t5_mask": (128,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_ltx.testing:write_tiny_ltx"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "ltx-video", LTXConfig, "LTX-Video (diffusers folder or original Lightricks single-file transformer)",
        video=(8, 1, 25), spatial_multiple=32, encoder_settings=("t5_max_length",), block_layers=("BlockLayer",),
    )
    folder = DiffusersFolder(
        "ltx-video", PIPELINES, COMPONENTS, sizes=SIZES, single_file_example="ltx-video-2b-v0.9.safetensors",
        file_layouts={"vae": vae_table},
    )
    model_class = "LTXVideoTransformer3DModel"
    single_file_markers = ("patchify_proj.weight",)
    file_config = {  # 2B or 13B, from the file itself (Lightricks' or diffusers' names; its config metadata too)
        "num_layers": blocks("transformer_blocks"),
        # LTX-Video's releases all have 32 heads (2B: 64 wide, 13B: 128): the width gives the head dim
        "attention_head_dim": Shape(weight_of("patchify_proj", "proj_in"), 0, per="num_attention_heads"),
        "in_channels": Shape(weight_of("patchify_proj", "proj_in"), 1),
        "caption_channels": Shape(weight_of("caption_projection.linear_1"), 1),
        "cross_attention_dim": Shape(weight_of("transformer_blocks.0.attn2.to_k"), 1),
    }
    single_file_name = "ltxv-transformer.safetensors"
    # attn1 (self) and attn2 (cross) projections and the feed-forward linears of every block; nothing else in the
    # model has modules of these names.
    lora_target_names = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")
    key_tables = "diffpipe_ltx.lightricks"

    def build_skeleton(self, model_config: LTXConfig, device: Any, dtype: torch.dtype) -> nn.Module:
        config = self.model_folder_config(model_config)
        patches = (config.get("patch_size", 1), config.get("patch_size_t", 1))
        if patches != (1, 1):
            raise ValueError(
                f"{model_config.path / 'transformer' / 'config.json'}: patch_size {patches[0]}, patch_size_t "
                f"{patches[1]}; diffpipe-ltx supports the released LTX-Video transformers (patch sizes 1)"
            )
        return super().build_skeleton(model_config, device, dtype)

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, F, H/32, W/32), ``(z - latents_mean) * scaling_factor / latents_std`` as the
        inverse of ``LTXPipeline._denormalize_latents`` (images are one frame), ``mask`` (B, 1, h, w) when given.
        Captions: ``t5_embeds`` (B, t5_max_length, d) and ``t5_mask`` (B, t5_max_length) bool, as
        ``LTXPipeline.encode_prompt`` makes them (T5 runs without the mask; the cross-attention uses it)."""
        from diffpipe_core.parts.latents import latent_mask
        from diffpipe_core.parts.text import TextEncoding, encode_text
        from diffpipe_ltx.packing import encode_latents

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = encode_latents(encoders.vae, batch.pixels)
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        if batch.captions is not None:
            text = encode_text(
                encoders.text_encoder, encoders.tokenizer, batch.captions, TextEncoding(encoders.config.t5_max_length)
            )
            out.update(t5_embeds=text.embeds, t5_mask=text.mask)
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: LTXConfig) -> list[nn.Module]:
        """Embedders (patch, time, caption, rotary), each transformer block, final norm/projection."""
        from diffpipe_ltx import layers
        from diffpipe_ltx.geometry import rope_interpolation_scale

        return layers.split_into_layers(model, rope_interpolation_scale(model_config))

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, t5_embeds, t5_mask, grid), (target, weight))`` (module docstring); rectified flow
        (:func:`diffpipe_core.parts.flow.flow_sample`) with ``shift`` or LTXPipeline's resolution shift, then the
        first-frame conditioning draw; all randomness from ``generator``."""
        import torch

        from diffpipe_core.diffusion import flux_resolution_shift
        from diffpipe_core.parts.flow import flow_sample
        from diffpipe_ltx.geometry import shift_constants
        from diffpipe_ltx.packing import pack

        cfg: LTXConfig = context.model_config  # type: ignore[assignment]
        latents = batch["latents"].float()
        b, _, f, h, w = latents.shape
        shift = flux_resolution_shift(f * h * w, *shift_constants(cfg)) if cfg.resolution_shift else cfg.shift
        s = flow_sample(latents, cfg, context, generator, shift)
        draw = torch.rand(b, generator=generator)  # drawn always, so p does not change the other draws
        conditioned = (draw < cfg.first_frame_conditioning_p) & (f > 1) & (context.eval_quantile is None)
        s.x_t[conditioned, :, 0] = latents[conditioned, :, 0]  # t = 0 on that frame: exactly the clean latents
        frame_t = s.t[:, None].repeat(1, f)
        frame_t[conditioned, 0] = 0.0
        weight = torch.ones(b, 1, f, h, w)
        weight[conditioned, :, 0] = 0.0
        if "mask" in batch:
            weight = weight * batch["mask"].float()[:, :, None]
        grid = torch.tensor([f, h, w], dtype=torch.long)
        inputs = (pack(s.x_t), frame_t, batch["t5_embeds"].float(), batch["t5_mask"].bool(), grid)
        return inputs, (pack(s.target), pack(weight))

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: LTXConfig, generator: torch.Generator):
        """Noise ``(1, C, (F - 1) / 8 + 1, H / 32, W / 32)`` and the folder's scheduler sigmas of
        ``linspace(1, 1/steps, steps)`` with ``LTXPipeline``'s sequence-length shift (``shift_terminal`` too)."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas
        from diffpipe_ltx.geometry import vae_compression

        temporal, spatial = vae_compression(self.folder.config(model_config.path, "vae"))
        channels = int(self.model_folder_config(model_config)["in_channels"])
        f, h, w = (request.frames - 1) // temporal + 1, request.height // spatial, request.width // spatial
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        schedule = scheduler_flow_sigmas(model_config.path, sigmas, f * h * w)
        return torch.randn((1, channels, f, h, w), generator=generator), schedule

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(packed x_t, t, t5_embeds, t5_mask, grid)``, ``t`` (B, 1): one time for every latent
        frame (a shape the layers read as that without reading values, so the GPU-fit table's meta forward runs)."""
        import torch

        from diffpipe_ltx.packing import pack

        b, _, f, h, w = latents.shape
        t = schedule[index].float().expand(b, 1)
        grid = torch.tensor([f, h, w], dtype=torch.long)
        return pack(latents.float()), t, text["t5_embeds"].float(), text["t5_mask"].bool(), grid

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        from diffpipe_ltx.packing import unpack

        return unpack(prediction, *latents.shape[2:])

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """``latents * latents_std / scaling_factor + latents_mean`` (``LTXPipeline._denormalize_latents``)."""
        from diffpipe_core.parts.latents import per_channel

        z = latents.float()
        return z * per_channel(vae.latents_std, z) / vae.config.scaling_factor + per_channel(vae.latents_mean, z)

    @hookimpl
    def decode_latents(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """:meth:`denormalize`, then the VAE (at decode timestep 0, ``LTXPipeline``'s default, when the VAE is
        timestep-conditioned); float RGB in [-1, 1], ``(B, 3, F, H, W)``."""
        import torch

        with torch.no_grad():
            z = self.denormalize(latents, decoder)
            param = next(decoder.parameters())
            temb = torch.zeros(z.shape[0], device=param.device, dtype=param.dtype)
            timestep = temb if decoder.config.timestep_conditioning else None
            return decoder.decode(z.to(param.device, param.dtype), timestep).sample.float().clamp(-1, 1)


plugin = LTXVideo()
