"""The AuraFlow model plugin (entry point ``auraflow``) on the core's shared plugin parts.

Grown from diffpipe's plugin template as an outside author rendered it (``tests/fixtures/diffpipe-acme-auraflow``).
No torch import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_auraflow.config import AuraFlowConfig
from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "AuraFlowTransformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": "UMT5EncoderModel",
    "tokenizer": TOKENIZER,
}


class AuraFlow(DiffusersModel, FlowSampling):
    """AuraFlow: joint (MMDiT) then single DiT blocks on UMT5 text features with register tokens; VAE factor 8 x 2x2
    patches = multiples of 16 pixels."""
    #: the released size (AuraFlow v0.3, 6.8 B) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: fal/AuraFlow-v0.3's transformer/config.json (diffusers' defaults but a 9216-patch position table); SDXL's VAE;
    #: Pile-T5-XL (2048) at text_max_length's default 256
    plan_size = {
        "transformer": {"sample_size": 64, "patch_size": 2, "in_channels": 4, "num_mmdit_layers": 4,
                        "num_single_dit_layers": 32, "attention_head_dim": 256, "num_attention_heads": 12,
                        "joint_attention_dim": 2048, "caption_projection_dim": 3072, "out_channels": 4,
                        "pos_embed_max_size": 9216},
        "vae": {"latent_channels": 4, "block_out_channels": [128, 256, 512, 512]},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 1.73},
        "text": {"text_embeds": (256, 2048)},
    }  # fmt: skip
    tiny_writer = "diffpipe_auraflow.testing:write_tiny_auraflow"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "auraflow", AuraFlowConfig, "AuraFlow v0.1-v0.3, Pony V7 (diffusers folder or original single file)",
        encoder_settings=("text_max_length",), block_layers=("BlockLayer", "SingleBlockLayer"),
    )
    folder = DiffusersFolder(
        "auraflow",
        ("AuraFlowPipeline",),
        COMPONENTS,
        sizes=(SizeMatch("text_encoder", "d_model", "joint_attention_dim", 4096),),
        single_file_example="pony-v7-base.safetensors",
        title="AuraFlow",
    )
    model_class = "AuraFlowTransformer2DModel"
    single_file_markers = ("double_layers.0.attn.w2q.weight", "cond_seq_linear.weight")
    single_file_name = "auraflow_transformer.safetensors"
    key_tables = "diffpipe_auraflow.original"  # the original layout: single files, exports, the ComfyUI LoRA
    file_config = {
        "num_mmdit_layers": r"(?:^|\.)(?:double_layers|joint_transformer_blocks)\.(\d+)\.",
        "num_single_dit_layers": r"(?:^|\.)(?:single_layers|single_transformer_blocks)\.(\d+)\.",
    }
    lora_target_names = (  # the joint and single blocks' attention and MLP linears (exact names or dotted suffixes)
        *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.linear_1", "ff.linear_2", "ff.out_projection"),
        *("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"),  # text side
        *("ff_context.linear_1", "ff_context.linear_2", "ff_context.out_projection"),
    )
    comfy_takes_diffusers_names = True  # ComfyUI's AuraFlow key map: transformer.<diffusers name> too (no fusing)
    sample_pipeline = "AuraFlowPipeline"
    sample_pipeline_settings = {"max_sequence_length": "text_max_length"}

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: AuraFlowConfig, device: torch.device) -> Any:
        """The VAE, and UMT5 with its tokenizer in an ``AuraFlowPipeline`` holding only them, so the prompt
        embeddings are its ``encode_prompt``'s."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.text = text_pipeline("AuraFlowPipeline", text_encoder=enc.text_encoder, tokenizer=enc.tokenizer)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 4, H/8, W/8) as ``mode * scaling_factor`` (SDXL's VAE), ``mask`` on the latent grid.
        Captions: ``text_embeds`` (B, text_max_length, d), zero after each caption's tokens, as
        ``AuraFlowPipeline.encode_prompt`` computes them (the transformer sees every position, as in the pipeline)."""
        import torch

        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = shift_and_scale(vae_mode(encoders.vae, batch.pixels), encoders.vae.config).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        if batch.captions is not None:
            with torch.no_grad():
                embeds, _, _, _ = encoders.text.encode_prompt(
                    list(batch.captions), do_classifier_free_guidance=False, device=encoders.device,
                    max_sequence_length=encoders.config.text_max_length,
                )
            out["text_embeds"] = embeds.float().cpu()
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: AuraFlowConfig) -> list[nn.Module]:
        """The embedders, each joint block, each single block, the output head (``layers.py``)."""
        from diffpipe_auraflow.layers import split_into_layers

        return split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds), (velocity[, mask]))``: rectified flow with the ``[model]`` time options."""
        from diffpipe_core.parts.flow import flow_sample, with_mask

        f = flow_sample(batch["latents"], context.model_config, context, generator)
        return (f.x_t, f.t, batch["text_embeds"].float()), with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: AuraFlowConfig, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` and the folder's own scheduler for ``request.steps`` (AuraFlow's: shift 1.73),
        as ``AuraFlowPipeline`` samples."""
        import torch

        from diffpipe_core.sampling.schedules import stepped_schedule

        noise = torch.randn(self.latent_shape(request, model_config), generator=generator)
        return noise, stepped_schedule(model_config.path, request.steps)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(x_t, t, text_embeds)``, the layout :meth:`prepare_inputs` gives the first layer; ``t`` the scheduler's
        timestep over its ``num_train_timesteps``, as the pipeline gives it."""
        from diffpipe_core.sampling.schedules import schedule_time

        t = schedule_time(schedule, index).float().expand(latents.shape[0])
        return latents.float(), t, text["text_embeds"].float()


plugin = AuraFlow()
