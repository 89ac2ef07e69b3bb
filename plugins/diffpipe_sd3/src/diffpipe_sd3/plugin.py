"""The Stable Diffusion 3 / 3.5 model plugin (entry point ``sd3``) on the core's shared plugin parts.

No torch import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_sd3.config import SD3Config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "SD3Transformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": "CLIPTextModelWithProjection",  # CLIP-L
    "text_encoder_2": "CLIPTextModelWithProjection",  # OpenCLIP bigG
    "text_encoder_3": "T5EncoderModel",  # T5-XXL
    "tokenizer": TOKENIZER,
    "tokenizer_2": TOKENIZER,
    "tokenizer_3": TOKENIZER,
}
#: every joint block's attention (image, text, SD3.5 Medium's second image attention) and MLP linears
BLOCK_LINEARS = (
    *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"),
    *("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"),
    *("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"),
    *("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
)


class SD3(DiffusersModel, FlowSampling):
    """SD3 / SD3.5: an MMDiT on CLIP-L + CLIP-G + T5 text features and a pooled CLIP vector; VAE factor 8 x 2x2
    patches = multiples of 16 pixels."""
    #: the released size (Stable Diffusion 3.5 Large, 8.1 B) for the GPU-fit table
    #: (diffpipe_core.engine.fit_table): stabilityai/stable-diffusion-3.5-large's transformer/config.json; its VAE (16
    #: channels, 8x); CLIP-L + bigG + T5-XXL's 77 + 256 tokens (4096 wide) and the pooled 2048
    plan_size = {
        "transformer": {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38,
                        "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096,
                        "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "out_channels": 16,
                        "pos_embed_max_size": 192, "qk_norm": "rms_norm"},
        "vae": {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512]},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0},
        "text": {"text_embeds": (333, 4096), "pooled": (2048,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_sd3.testing:write_tiny_sd3"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "sd3", SD3Config,
        "Stable Diffusion 3 Medium, 3.5 Medium / Large / Large Turbo (diffusers folder or Stability's single file)",
        encoder_settings=("text_max_length", "t5"), block_layers=("JointLayer",),
    )
    folder = DiffusersFolder(
        "sd3",
        ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline"),
        COMPONENTS,
        sizes=(SizeMatch("text_encoder_3", "d_model", "joint_attention_dim", 4096),),
        single_file_example="sd3.5_large.safetensors",
        title="SD3",
    )
    model_class = "SD3Transformer2DModel"
    single_file_markers = ("joint_blocks.0.x_block.attn.qkv.weight", "x_embedder.proj.weight")
    single_file_name = "sd3_transformer.safetensors"
    key_tables = "diffpipe_sd3.original"  # Stability's MMDiT layout: single files, exports, the ComfyUI LoRA
    file_config = {"num_layers": r"(?:^|\.)(?:joint_blocks|transformer_blocks)\.(\d+)\."}
    lora_target_names = BLOCK_LINEARS
    last_block_unused = ("attn.add_q_proj",)  # the last block's text queries: its text output is never read
    sample_pipeline = "StableDiffusion3Pipeline"
    sample_pipeline_settings = {"max_sequence_length": "text_max_length"}

    def build_skeleton(self, model_config: SD3Config, device: Any, dtype: torch.dtype) -> nn.Module:
        """The shared skeleton, with the position table (a buffer every SD3 file holds) on ``meta`` too when the
        rest is, so only the stage holding the patch embedding reads it from the file."""
        import torch

        model = super().build_skeleton(model_config, device, dtype)
        if torch.device(device).type == "meta":
            table = model.pos_embed.pos_embed
            model.pos_embed.register_buffer("pos_embed", torch.empty_like(table, device="meta"), persistent=True)
        return model

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: SD3Config, device: torch.device) -> Any:
        """The VAE and the text encoders (T5 only with ``t5``), in a ``StableDiffusion3Pipeline`` holding only them
        so that the prompt embeddings are its ``encode_prompt``'s."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        names = ["vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"]
        if model_config.t5:
            names += ["text_encoder_3", "tokenizer_3"]
        enc = load_components(self.folder, model_config, device, *names)
        enc.text = text_pipeline("StableDiffusion3Pipeline", **{n: getattr(enc, n) for n in names if n != "vae"})
        if not model_config.t5:  # encode_prompt reads only the width of the zero T5 tokens from the transformer
            width = int(self.model_folder_config(model_config).get("joint_attention_dim", 4096))
            object.__setattr__(enc.text, "transformer", _Width(width))
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 16, H/8, W/8) as ``(mode - shift_factor) * scaling_factor``, ``mask`` on the latent
        grid. Captions: ``text_embeds`` (B, 77 + text_max_length, 4096) (CLIP-L and CLIP-G penultimate states side by
        side, zero-padded to T5's width, then T5's tokens) and ``pooled`` (B, 2048), as
        ``StableDiffusion3Pipeline.encode_prompt`` computes them."""
        import torch

        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = shift_and_scale(vae_mode(encoders.vae, batch.pixels), encoders.vae.config).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        if batch.captions is not None:
            with torch.no_grad():
                embeds, _, pooled, _ = encoders.text.encode_prompt(
                    list(batch.captions), None, None, device=encoders.device, do_classifier_free_guidance=False,
                    max_sequence_length=encoders.config.text_max_length,
                )
            out["text_embeds"], out["pooled"] = embeds.float().cpu(), pooled.float().cpu()
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: SD3Config) -> list[nn.Module]:
        """The embedders, each joint block, the output head (``layers.py``)."""
        from diffpipe_sd3.layers import split_into_layers

        return split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, pooled), (velocity[, mask]))``: rectified flow
        (:func:`diffpipe_core.parts.flow.flow_sample`) with ``shift``."""
        from diffpipe_core.parts.flow import flow_sample, with_mask

        f = flow_sample(batch["latents"], context.model_config, context, generator)
        inputs = (f.x_t, f.t, batch["text_embeds"].float(), batch["pooled"].float())
        return inputs, with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: SD3Config, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` and the folder's own scheduler for ``request.steps`` (SD3's: shift 3), as
        ``StableDiffusion3Pipeline`` samples."""
        import torch

        from diffpipe_core.sampling.schedules import stepped_schedule

        noise = torch.randn(self.latent_shape(request, model_config), generator=generator)
        return noise, stepped_schedule(model_config.path, request.steps)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(x_t, t, text_embeds, pooled)``, the layout :meth:`prepare_inputs` gives the first layer; ``t`` the
        scheduler's timestep over its ``num_train_timesteps``."""
        from diffpipe_core.sampling.schedules import schedule_time

        t = schedule_time(schedule, index).float().expand(latents.shape[0])
        return latents.float(), t, text["text_embeds"].float(), text["pooled"].float()


class _Width:
    """What ``StableDiffusion3Pipeline.encode_prompt`` reads of its transformer without a T5: the width of the zero
    tokens it puts in T5's place (``config.joint_attention_dim``)."""

    def __init__(self, width: int) -> None:
        from types import SimpleNamespace

        self.config = SimpleNamespace(joint_attention_dim=width)


plugin = SD3()
