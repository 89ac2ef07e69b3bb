"""The Lumina Image 2.0 model plugin (entry point ``lumina2``) on the core's shared plugin parts.

No torch import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_lumina.config import Lumina2Config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "Lumina2Transformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": ("Gemma2Model", "Gemma2ForCausalLM"),
    "tokenizer": TOKENIZER,
}
X_EMBEDDER = weight_of("x_embedder")
HEAD_DIM = Shape(weight_of("layers.0.attention.q_norm", "layers.0.attn.norm_q"), 0)  # a per-head RMS norm


class Lumina2(DiffusersModel, FlowSampling):
    """Lumina Image 2.0: a single-stream DiT (NextDiT) with caption and image refiner blocks on Gemma 2 text features;
    Flux's VAE (factor 8) x 2x2 patches = multiples of 16 pixels."""
    #: the released size (Lumina-Image 2.0, 2.6 B) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: Alpha-VLLM/Lumina-Image-2.0's transformer/config.json (diffusers' defaults with Gemma-2-2B's 2304-wide caption
    #: features); FLUX.1's VAE; text_max_length's default 256
    plan_size = {
        "transformer": {"sample_size": 128, "patch_size": 2, "in_channels": 16, "hidden_size": 2304, "num_layers": 26,
                        "num_refiner_layers": 2, "num_attention_heads": 24, "num_kv_heads": 8, "multiple_of": 256,
                        "norm_eps": 1e-05, "axes_dim_rope": [32, 32, 32], "axes_lens": [300, 512, 512],
                        "cap_feat_dim": 2304},
        "vae": {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512]},
        "text": {"text_embeds": (256, 2304), "text_mask": (256,)},
    }  # fmt: skip

    tiny_writer = "diffpipe_lumina.testing:write_tiny_lumina2"  # python -m diffpipe_core.testing.tiny_models
    spec = diffusers_spec(
        "lumina2", Lumina2Config, "Lumina Image 2.0 (diffusers folder or original single-file transformer)",
        encoder_settings=("text_max_length", "system_prompt"),
        block_layers=("ContextRefinerLayer", "NoiseRefinerLayer", "MainLayer"),
    )
    folder = DiffusersFolder(
        "lumina2",
        ("Lumina2Pipeline",),
        COMPONENTS,
        sizes=(SizeMatch("text_encoder", "hidden_size", "cap_feat_dim", 2304),),
        single_file_example="lumina_2_model_bf16.safetensors",
        title="Lumina 2",
    )
    model_class = "Lumina2Transformer2DModel"
    # adaLN_modulation.1: a SiLU before the linear (Z-Image, of the same family, has adaLN_modulation.0)
    single_file_markers = ("layers.0.attention.qkv.weight", "layers.0.adaLN_modulation.1.weight")
    single_file_name = "lumina2_transformer.safetensors"
    key_tables = "diffpipe_lumina.original"  # the original layout: single files, exports, the ComfyUI LoRA
    file_config = {  # block counts and widths from the file itself (the original or diffusers' names)
        "num_layers": blocks("layers"),
        "num_refiner_layers": blocks("noise_refiner"),
        "hidden_size": Shape(X_EMBEDDER, 0),
        "num_attention_heads": Shape(X_EMBEDDER, 0, per=HEAD_DIM),
        "cap_feat_dim": Shape(weight_of("cap_embedder.1", "time_caption_embed.caption_embedder.1"), 1),
    }
    lora_target_names = (  # every block's attention and feed-forward linears, and the adaLN linear where modulated
        *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"),
        *("feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3", "norm1.linear"),
    )
    sample_pipeline = "Lumina2Pipeline"
    sample_pipeline_settings = {
        "max_sequence_length": "text_max_length",
        "system_prompt": "system_prompt",
        "cfg_normalization": "cfg_normalization",
        "cfg_trunc_ratio": "cfg_trunc_ratio",
    }

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: Lumina2Config, device: torch.device) -> Any:
        """The VAE, and Gemma 2 with its tokenizer in a ``Lumina2Pipeline`` holding only them, so the system prompt,
        the hidden layer (the penultimate) and the mask are its ``encode_prompt``'s."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.text = text_pipeline("Lumina2Pipeline", text_encoder=enc.text_encoder, tokenizer=enc.tokenizer)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 16, H/8, W/8) as ``(mode - shift_factor) * scaling_factor`` (Flux's VAE), ``mask`` on
        the latent grid. Captions: ``text_embeds`` (B, text_max_length, d) and ``text_mask`` (B, text_max_length) as
        ``Lumina2Pipeline.encode_prompt`` computes them (``[model] system_prompt`` first); a sample's negative prompt
        without the system prompt, as the pipeline encodes its negative prompt."""
        import torch

        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = shift_and_scale(vae_mode(encoders.vae, batch.pixels), encoders.vae.config).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        if batch.captions is not None:
            cfg, captions = encoders.config, list(batch.captions)
            with torch.no_grad():
                if getattr(batch, "negative_prompt", False):
                    embeds, mask = encoders.text._get_gemma_prompt_embeds(
                        captions, device=encoders.device, max_sequence_length=cfg.text_max_length
                    )
                else:
                    embeds, mask, _, _ = encoders.text.encode_prompt(
                        captions, do_classifier_free_guidance=False, device=encoders.device,
                        system_prompt=cfg.system_prompt, max_sequence_length=cfg.text_max_length,
                    )
            out["text_embeds"], out["text_mask"] = embeds.float().cpu(), mask.long().cpu()
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: Lumina2Config) -> list[nn.Module]:
        """Embedders, each context-refiner, noise-refiner and main block, the output head (``layers.py``)."""
        from diffpipe_lumina.layers import split_into_layers

        return split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, text_mask), (velocity[, mask]))``: rectified flow with ``t`` = 1 at the noise
        (the first layer hands the transformer ``1 - t``), shifted by ``shift`` or, with ``lumina_shift``, by the
        image's patch count."""
        from diffpipe_core.diffusion import flux_resolution_shift
        from diffpipe_core.parts.flow import flow_sample, with_mask

        cfg = context.model_config
        h, w = batch["latents"].shape[-2:]
        shift = flux_resolution_shift((h // 2) * (w // 2)) if cfg.lumina_shift else cfg.shift
        f = flow_sample(batch["latents"], cfg, context, generator, shift=shift)
        inputs = (f.x_t, f.t, batch["text_embeds"].float(), batch["text_mask"].long())
        return inputs, with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: Lumina2Config, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` and the folder scheduler's sigmas of ``linspace(1, 1/steps, steps)``, as
        ``Lumina2Pipeline`` makes them (its ``mu``, used only by a dynamically shifting scheduler, from
        ``latents.shape[1]``: the channel count)."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        shape = self.latent_shape(request, model_config)
        base = np.linspace(1.0, 1 / request.steps, request.steps)
        schedule = scheduler_flow_sigmas(model_config.path, base, image_seq_len=shape[1])
        return torch.randn(shape, generator=generator), schedule

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds, text_mask)``; ``t`` the schedule's sigma."""
        t = schedule[index].float().expand(latents.shape[0])
        return latents.float(), t, text["text_embeds"].float(), text["text_mask"].long()

    @hookimpl
    def combine_guidance(self, uncond, cond, scale, schedule, index, model_config):
        """``Lumina2Pipeline``'s guidance: ``uncond + scale * (cond - uncond)`` rescaled to the norm of ``cond`` along
        the last axis (``cfg_normalization``), and ``cond`` alone after the first ``cfg_trunc_ratio`` of the
        steps."""
        steps = len(schedule) - 1
        if (index + 1) / steps > model_config.cfg_trunc_ratio:
            return cond
        guided = uncond + scale * (cond - uncond)
        if model_config.cfg_normalization:
            guided = guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
        return guided


plugin = Lumina2()
