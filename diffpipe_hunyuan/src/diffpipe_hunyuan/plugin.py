"""The HunyuanVideo model plugin (entry point ``hunyuan-video``) on the core's shared plugin parts.

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
from diffpipe_hunyuan.config import HunyuanConfig
from diffpipe_hunyuan.vae_layouts import ldm_vae_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

DOUBLE_BLOCK_LINEARS = (
    *JOINT_ATTENTION,
    *("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear", "norm1_context.linear"),
)
SINGLE_BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out", "norm.linear")
DEFAULT_GUIDANCE = 6.0  # HunyuanVideoPipeline's guidance_scale default (the distilled guidance embedding)
COMPONENTS = {
    "transformer": "HunyuanVideoTransformer3DModel",
    "vae": "AutoencoderKLHunyuanVideo",
    "text_encoder": ("LlamaModel", "LlamaForCausalLM"),
    "text_encoder_2": "CLIPTextModel",
    "tokenizer": TOKENIZER,
    "tokenizer_2": TOKENIZER,
}

#: (original, diffusers) names shared with HunyuanVideo-1.5's files
IMG_IN = ("img_in.proj", "x_embedder.proj")
TXT_IN = ("txt_in.input_embedder", "context_embedder.proj_in")
REFINER_BLOCKS = ("txt_in.individual_token_refiner.blocks", "context_embedder.token_refiner.refiner_blocks")
#: what a double- and single-stream transformer file's tensors say of its size (HunyuanVideo and HunyuanImage-2.1)
FILE_SIZES = {
    "num_layers": blocks("double_blocks", "transformer_blocks"),
    "num_single_layers": blocks("single_blocks", "single_transformer_blocks"),
    "num_refiner_layers": blocks(*REFINER_BLOCKS),
    "num_attention_heads": Shape(weight_of(*IMG_IN), 0, per="attention_head_dim"),
    "in_channels": Shape(weight_of(*IMG_IN), 1),
    "text_embed_dim": Shape(weight_of(*TXT_IN), 1),
}


def block_linears(config: dict[str, Any]) -> list[str]:
    """Every linear of the double- and single-stream blocks of a transformer of ``config``, by full name."""
    n_double, n_single = int(config["num_layers"]), int(config["num_single_layers"])
    doubles = [f"transformer_blocks.{i}.{m}" for i in range(n_double) for m in DOUBLE_BLOCK_LINEARS]
    return doubles + [f"single_transformer_blocks.{i}.{m}" for i in range(n_single) for m in SINGLE_BLOCK_LINEARS]


class HunyuanVideo(DiffusersModel, FlowSampling):
    """HunyuanVideo: a video model (images train as 1-frame videos); VAE 8x spatial x 2x2 patches = multiples of 16
    pixels; 4x temporal, so frame counts are 4k + 1; clips resampled to 24 fps."""
    tiny_writer = "diffpipe_hunyuan.testing:write_tiny_hunyuan"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "hunyuan-video", HunyuanConfig,
        "HunyuanVideo text-to-video (diffusers folder or original single-file transformer)",
        video=(4, 1, 24.0), block_layers=("DoubleBlockLayer", "SingleBlockLayer"),
        sequence_tensors=((0, 1), (3, 0), (4, 0)),  # the video tokens and their rotary cos / sin (layers.py)
        encoder_settings=("text_max_length", "text_crop_start", "vae_tiling", "vae_tile_size", "vae_tile_frames"),
    )
    folder = DiffusersFolder(
        "hunyuan-video", ("HunyuanVideoPipeline",), COMPONENTS, file_layouts={"vae": ldm_vae_table}
    )
    model_class = "HunyuanVideoTransformer3DModel"
    #: the released size (HunyuanVideo, 12.8 B) for the model page's GPU-fit table (diffpipe_core.engine.fit_table)
    plan_size = {
        "transformer": {"in_channels": 16, "out_channels": 16, "num_attention_heads": 24, "attention_head_dim": 128,
                        "num_layers": 20, "num_single_layers": 40, "num_refiner_layers": 2, "mlp_ratio": 4.0,
                        "patch_size": 2, "patch_size_t": 1, "qk_norm": "rms_norm", "guidance_embeds": True,
                        "text_embed_dim": 4096, "pooled_projection_dim": 768, "rope_theta": 256.0,
                        "rope_axes_dim": [16, 56, 56]},
        "vae": {"latent_channels": 16, "spatial_compression_ratio": 8, "temporal_compression_ratio": 4},
        "text": {"text_embeds": (256, 4096), "text_mask": (256,), "clip_pooled": (768,)},
    }  # fmt: skip
    single_file_markers = ("double_blocks.0.img_attn_qkv.weight", "single_blocks.0.linear1.weight")
    single_file_name = "hunyuan_video_transformer.safetensors"
    file_config = {  # block counts, width and flags from the file itself (Tencent's, ComfyUI's or diffusers' names)
        **FILE_SIZES,
        "pooled_projection_dim": Shape(weight_of("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"), 1),
        "guidance_embeds": present("guidance_in", "time_text_embed.guidance_embedder"),
    }
    key_tables = "diffpipe_hunyuan.original"

    def default_lora_targets(self, model_config: HunyuanConfig) -> list[str]:
        """Every linear of the double- and single-stream blocks (attention, MLP, modulation), by full name: the
        token refiner and the final layer use the same short names and are not adapted."""
        return block_linears(self.model_folder_config(model_config))

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: HunyuanConfig, device: torch.device) -> Any:
        """The video VAE (tiling/slicing as configured), and Llama + CLIP-L in a ``HunyuanVideoPipeline`` holding only
        them, so the prompt template, its crop, the hidden layer (third from last) and the mask are the pipeline's."""
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline
        from diffpipe_hunyuan.vae import configure_vae

        enc = load_components(
            self.folder, model_config, device, "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"
        )
        configure_vae(enc.vae, model_config)
        enc.text = text_pipeline(
            "HunyuanVideoPipeline",
            text_encoder=enc.text_encoder,
            tokenizer=enc.tokenizer,
            text_encoder_2=enc.text_encoder_2,
            tokenizer_2=enc.tokenizer_2,
        )
        enc.template = {**DEFAULT_PROMPT_TEMPLATE, "crop_start": model_config.text_crop_start}
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, F', H/8, W/8) scaled (images as 1 frame), ``mask`` (B, 1, 1, h, w) when given.
        Captions: ``text_embeds`` (B, text_max_length, d), ``text_mask`` (B, text_max_length), ``clip_pooled`` (B, d),
        from ``HunyuanVideoPipeline.encode_prompt``."""
        import torch

        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            z = vae_mode(encoders.vae, batch.pixels, video=True)
            out["latents"] = shift_and_scale(z, encoders.vae.config).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape, video=True).cpu()
        if batch.captions is not None:
            cfg = encoders.config
            with torch.no_grad():
                embeds, pooled, mask = encoders.text.encode_prompt(
                    batch.captions,
                    prompt_template=encoders.template,
                    device=encoders.device,
                    dtype=encoders.text_encoder.dtype,
                    max_sequence_length=cfg.text_max_length,
                )
            out.update(text_embeds=embeds.float().cpu(), text_mask=mask.long().cpu(), clip_pooled=pooled.float().cpu())
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: HunyuanConfig) -> list[nn.Module]:
        """Embedders + token refiner (+ rotary embedding, computed once), each double block, each single block,
        final norm/projection."""
        from diffpipe_hunyuan import layers

        return layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, text_mask, clip_pooled, guidance), (target[, mask]))`` on the video latents
        ``(B, C, F, h, w)`` (images: F = 1); rectified flow (:func:`diffpipe_core.parts.flow.flow_sample`)."""
        import torch

        from diffpipe_core.parts.flow import flow_sample, with_mask

        cfg: HunyuanConfig = context.model_config  # type: ignore[assignment]
        f = flow_sample(batch["latents"], cfg, context, generator)
        guidance = torch.full((f.t.shape[0],), float(cfg.guidance))
        text = batch["text_embeds"].float(), batch["text_mask"].long(), batch["clip_pooled"].float()
        return (f.x_t, f.t, *text, guidance), with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: HunyuanConfig, generator: torch.Generator):
        """Noise ``(1, C, (F - 1) / 4 + 1, H / 8, W / 8)`` and the folder's scheduler sigmas of
        ``linspace(1, 0, steps + 1)[:-1]``, as ``HunyuanVideoPipeline`` makes them."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        vae = self.folder.config(model_config.path, "vae")
        spatial, temporal = int(vae.get("spatial_compression_ratio", 8)), int(vae.get("temporal_compression_ratio", 4))
        channels = int(self.model_folder_config(model_config)["in_channels"])
        shape = (1, channels, (request.frames - 1) // temporal + 1, request.height // spatial, request.width // spatial)
        sigmas = np.linspace(1.0, 0.0, request.steps + 1)[:-1]
        return torch.randn(shape, generator=generator), scheduler_flow_sigmas(model_config.path, sigmas)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds, text_mask, clip_pooled, guidance)`` (``[sample] guidance``,
        default 6.0, fed to the guidance embedding)."""
        import torch

        b = latents.shape[0]
        guidance = DEFAULT_GUIDANCE if request.guidance is None else request.guidance
        t = schedule[index].float().expand(b)
        embeds, mask, pooled = text["text_embeds"].float(), text["text_mask"].long(), text["clip_pooled"].float()
        return latents.float(), t, embeds, mask, pooled, torch.full((b,), float(guidance))


plugin = HunyuanVideo()
