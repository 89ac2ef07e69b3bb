"""The HunyuanVideo-1.5 model plugin (entry point ``hunyuan-video-1.5``: text-to-video, images as 1-frame videos) on
the core's shared plugin parts; :mod:`diffpipe_hunyuan.i2v15` adds ``hunyuan-video-1.5-i2v``.

The first layer gets ``(x_t, t, text_embeds, text_mask, glyph_embeds, glyph_mask)``: the noisy latents
``(B, C, F, h, w)``, the flow time, the Qwen2.5-VL and glyph-ByT5 embeddings as ``HunyuanVideo15Pipeline.encode_prompt``
makes them; the loss targets are the velocity and the dataset's loss mask. No torch import at the top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_hunyuan.config import HunyuanVideo15Config
from diffpipe_hunyuan.plugin import DOUBLE_BLOCK_LINEARS, IMG_IN, REFINER_BLOCKS, TXT_IN
from diffpipe_hunyuan.vae_layouts import vae15_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "HunyuanVideo15Transformer3DModel",
    "vae": "AutoencoderKLHunyuanVideo15",
    "text_encoder": "Qwen2_5_VLTextModel",
    "text_encoder_2": "T5EncoderModel",
    "tokenizer": TOKENIZER,
    "tokenizer_2": TOKENIZER,
}
#: the layouts a ``[model] vae`` file may be in besides diffusers' names (ComfyUI's, which is Tencent's)
FILE_LAYOUTS = {"vae": vae15_table}
#: the last double block's text-side linears: nothing after the last block reads its text stream (1.5 has no
#: single-stream blocks), so a LoRA on them would get no gradient
LAST_BLOCK_UNUSED = ("attn.add_q_proj", "attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2")
TEXT_KEYS = ("text_embeds", "text_mask", "glyph_embeds", "glyph_mask")
#: what caching loads (and the pipeline ``encode_prompt`` runs in holds)
TEXT_COMPONENTS = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


class HunyuanVideo15(DiffusersModel, FlowSampling):
    """HunyuanVideo-1.5: a video model (images train as 1-frame videos); VAE 16x spatial, patch 1 = multiples of 16
    pixels; 4x temporal, so frame counts are 4k + 1; clips resampled to 24 fps."""
    #: the released size (HunyuanVideo-1.5 480p text-to-video, 8.3 B) for the GPU-fit table
    #: (diffpipe_core.engine.fit_table): the 480p text-to-video transformer/config.json of the diffusers conversion
    #: (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v); the VAE's 32 channels at 16x;
    #: Qwen2.5-VL-7B (3584 wide) at text_max_length 1000 and ByT5's glyph features (1472) at 256
    plan_size = {
        "transformer": {"in_channels": 65, "out_channels": 32, "num_attention_heads": 16, "attention_head_dim": 128,
                        "num_layers": 54, "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 1, "patch_size_t": 1,
                        "qk_norm": "rms_norm", "text_embed_dim": 3584, "text_embed_2_dim": 1472,
                        "image_embed_dim": 1152,
                        "rope_theta": 256.0, "rope_axes_dim": [16, 56, 56], "target_size": 640, "task_type": "t2v",
                        "use_meanflow": False},
        "vae": {"latent_channels": 32, "spatial_compression_ratio": 16, "temporal_compression_ratio": 4},
        "text": {"text_embeds": (1000, 3584), "text_mask": (1000,), "glyph_embeds": (256, 1472), "glyph_mask": (256,)},
    }  # fmt: skip
    #: 33 frames at both sizes: diffusers' attention processor makes a (tokens x tokens) boolean mask per block, which
    #: the meta forward builds for real (848x480x81 is 35k tokens: 1.2 GB a mask, minutes per table)
    plan_resolutions = [(512, 512, 33), (848, 480, 33)]
    tiny_writer = "diffpipe_hunyuan.testing15:write_tiny_hunyuan15"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "hunyuan-video-1.5", HunyuanVideo15Config,
        "HunyuanVideo-1.5 text-to-video (diffusers folder or Tencent's single-file transformer)",
        video=(4, 1, 24.0), block_layers=("DoubleBlockLayer",),
        encoder_settings=("text_max_length", "text_crop_start", "glyph_max_length", "vae_tiling"),
    )
    folder = DiffusersFolder("hunyuan-video-1.5", ("HunyuanVideo15Pipeline",), COMPONENTS, file_layouts=FILE_LAYOUTS)
    model_class = "HunyuanVideo15Transformer3DModel"
    single_file_markers = ("double_blocks.0.img_attn_q.weight", "byt5_in.fc1.weight")
    single_file_name = "hunyuan_video_1.5_transformer.safetensors"
    file_config = {  # block counts and widths from the file itself (Tencent's, ComfyUI's or diffusers' names)
        "num_layers": blocks("double_blocks", "transformer_blocks"),
        "num_refiner_layers": blocks(*REFINER_BLOCKS),
        "num_attention_heads": Shape(weight_of(*IMG_IN), 0, per="attention_head_dim"),
        "in_channels": Shape(weight_of(*IMG_IN), 1),
        "text_embed_dim": Shape(weight_of(*TXT_IN), 1),
        "text_embed_2_dim": Shape(weight_of("byt5_in.fc1", "context_embedder_2.linear_1"), 1),
        "image_embed_dim": Shape(weight_of("vision_in.proj.1", "image_embedder.linear_1"), 1),
    }
    key_tables = "diffpipe_hunyuan.original15"
    pipeline_class = "HunyuanVideo15Pipeline"
    encoder_components = TEXT_COMPONENTS

    def default_lora_targets(self, model_config: HunyuanVideo15Config) -> list[str]:
        """Every linear of the double blocks (attention, MLP, modulation) by full name (the token refiner uses the same
        short names and is not adapted), less the last block's :data:`LAST_BLOCK_UNUSED`."""
        n = int(self.model_folder_config(model_config)["num_layers"])
        return [
            f"transformer_blocks.{i}.{m}"
            for i in range(n)
            for m in DOUBLE_BLOCK_LINEARS
            if not (i == n - 1 and m in LAST_BLOCK_UNUSED)
        ]

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: HunyuanVideo15Config, device: torch.device) -> Any:
        """:attr:`encoder_components` (the VAE, tiling as configured; Qwen2.5-VL and ByT5; SigLIP for -i2v), the text
        encoders in a pipeline of :attr:`pipeline_class` holding them, so the chat template, its crop, the hidden
        layer (third from last), the glyph-text extraction and the masks are the pipeline's; its lengths are the
        ``[model]`` ones."""
        from diffpipe_core.parts.text import text_pipeline

        enc = super().load_encoders(model_config, device)
        if model_config.vae_tiling:
            enc.vae.enable_tiling()
        # one sample at a time: diffusers 0.42's AutoencoderKLHunyuanVideo15 attention mask (B, S, S) does not
        # broadcast against its (B, 1, S, C) queries for a batch of more than one
        enc.vae.enable_slicing()
        enc.text = text_pipeline(self.pipeline_class, **{n: getattr(enc, n) for n in TEXT_COMPONENTS})
        enc.text.tokenizer_max_length = model_config.text_max_length
        enc.text.prompt_template_encode_start_idx = model_config.text_crop_start
        enc.text.tokenizer_2_max_length = model_config.glyph_max_length
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: :meth:`encode_media`. Captions: ``text_embeds`` (B, text_max_length, d), ``text_mask``,
        ``glyph_embeds`` (B, glyph_max_length, d2), ``glyph_mask`` from the pipeline's ``encode_prompt``."""
        import torch

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out.update(self.encode_media(encoders, batch))
        if batch.captions is not None:
            with torch.no_grad():
                found = encoders.text.encode_prompt(
                    batch.captions, device=encoders.device, dtype=torch.float32, batch_size=len(batch.captions)
                )
            for key, value in zip(TEXT_KEYS, found, strict=True):
                out[key] = (value.long() if key.endswith("mask") else value.float()).cpu()
        return out

    def encode_media(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """``latents`` (B, C, F', H/16, W/16) times the VAE's ``scaling_factor`` (images as 1 frame), ``mask``
        (B, 1, 1, h, w) when given."""
        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode

        latents = shift_and_scale(vae_mode(encoders.vae, batch.pixels, video=True), encoders.vae.config).cpu()
        out = {"latents": latents}
        if batch.masks is not None:
            out["mask"] = latent_mask(batch.masks, latents.shape, video=True).cpu()
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: HunyuanVideo15Config) -> list[nn.Module]:
        """Embedders and the joint text sequence (+ rotary embedding, computed once), each double block, final
        norm/projection."""
        from diffpipe_hunyuan import layers15

        return layers15.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, text_mask, glyph_embeds, glyph_mask), (target[, mask]))`` on the video latents
        (images: F = 1); rectified flow (:func:`diffpipe_core.parts.flow.flow_sample`)."""
        from diffpipe_core.parts.flow import with_mask

        f = self.noisy(batch, context, generator)
        return (f.x_t, f.t, *self.text_inputs(batch)), with_mask((f.target,), batch)

    def noisy(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator) -> Any:
        """The noised latents, time and velocity target of ``batch`` (noise, then t, from ``generator``)."""
        from diffpipe_core.parts.flow import flow_sample

        return flow_sample(batch["latents"], context.model_config, context, generator)

    @staticmethod
    def text_inputs(text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``(text_embeds, text_mask, glyph_embeds, glyph_mask)``: embeddings float, masks long."""
        return tuple(text[k].long() if k.endswith("mask") else text[k].float() for k in TEXT_KEYS)

    # ------------------------------------------------------------------------------------------ sampling
    def latent_shape(self, model_config: HunyuanVideo15Config, request: SampleRequest) -> tuple[int, ...]:
        """``(1, C, (F - 1) / 4 + 1, H / 16, W / 16)``, as the pipelines' ``prepare_latents`` make it."""
        vae = self.folder.config(model_config.path, "vae")
        spatial, temporal = int(vae.get("spatial_compression_ratio", 16)), int(vae.get("temporal_compression_ratio", 4))
        frames = (request.frames - 1) // temporal + 1
        return 1, int(vae.get("latent_channels", 32)), frames, request.height // spatial, request.width // spatial

    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: HunyuanVideo15Config, generator: torch.Generator):
        """Noise of :meth:`latent_shape` and the folder's scheduler sigmas of ``linspace(1, 0, steps + 1)[:-1]``, as
        the pipeline makes them."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        sigmas = np.linspace(1.0, 0.0, request.steps + 1)[:-1]
        noise = torch.randn(self.latent_shape(model_config, request), generator=generator)
        return noise, scheduler_flow_sigmas(model_config.path, sigmas)

    @hookimpl
    def load_decoder(self, model_config: HunyuanVideo15Config, device: torch.device) -> Any:
        """The VAE alone, decoding one sample at a time (see :meth:`load_encoders`)."""
        vae = super().load_decoder(model_config, device)
        vae.enable_slicing()
        return vae

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds, text_mask, glyph_embeds, glyph_mask)`` (no conditioning: the
        pipeline's zero condition latents and image embeddings)."""
        b = latents.shape[0]
        return latents.float(), schedule[index].float().expand(b), *self.text_inputs(text)


plugin = HunyuanVideo15()
