"""Qwen-Image 2.1 (entry points ``qwen-image-2.1`` and ``qwen-image-2.1-turbo``) on the core's shared plugin parts and
Qwen-Image's own (its ComfyUI layout, the cut of cached text, the pipeline's dynamic training shift).

Qwen-Image 2.1 is a single-stream transformer: the caption's Qwen3-VL hidden states and the target's latent pixels
(a 64-channel VAE at 16x, unpatched) form one sequence under block-causal attention (text causal, each image block
bidirectional), text tokens modulated at t = 0 (``causal_condition``). Text-to-image training; the image-conditioned
mode (reference images inside the text) is not trained yet. This module imports no torch: hooks import it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_qwenimage.config import QwenImage21Config, QwenImage21TurboConfig
from diffpipe_qwenimage.plugin import comfy_layout, trimmed

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.parts.layout import KeyTable
    from diffpipe_core.types import SampleRequest

log = logging.getLogger("diffpipe.qwenimage")
LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out")
COMPONENTS = {
    "transformer": "QwenImage21Transformer2DModel",
    "vae": "AutoencoderKLQwenImage21",
    "text_encoder": "Qwen3VLForConditionalGeneration",
    "processor": TOKENIZER,
}
#: FlowMatchEulerDiscreteScheduler's own defaults, which QwenImage21Pipeline's calculate_shift falls back to
SCHEDULER = {"use_dynamic_shifting": False, "base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
             "max_shift": 1.15, "shift": 1.0, "time_shift_type": "exponential"}


class QwenImage21(DiffusersModel, FlowSampling):
    """Qwen-Image 2.1: one sequence of Qwen3-VL text features and the target's latent pixels (sizes in multiples of 32
    pixels: a 16x VAE whose 2x2 latent groups fill the text encoder's image slots)."""
    #: the released size (Qwen-Image 2.1) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: diffusers' QwenImage21Transformer2DModel defaults, which are the release's transformer/config.json; text
    #: features 4096 wide at text_max_length's default 512; its RGBA VAE (64 channels, 16x)
    plan_size = {
        "transformer": {"patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 32,
                        "attention_head_dim": 128, "num_attention_heads": 32, "context_in_dim": 4096, "mlp_ratio": 3,
                        "axes_dims_rope": [16, 56, 56]},
        "vae": {"in_channels": 4, "z_dim": 64, "temperal_downsample": [False, True, True, True]},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True,
                      "time_shift_type": "exponential", "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
                      "max_image_seq_len": 8192, "shift": 1.0},
        "text": {"text_embeds": (512, 4096), "text_mask": (512,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_qwenimage.testing21:write_tiny_qwen21"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "qwen-image-2.1", QwenImage21Config,
        "Qwen-Image 2.1 text-to-image (diffusers folder, or ComfyUI's single-file transformer over it)",
        contract=4, encoder_settings=("text_max_length",), block_layers=("BlockLayer",), spatial_multiple=32,
        guidance_in_one_batch=False,  # padding the shorter prompt would move the image's positions
    )
    folder = DiffusersFolder(
        "qwen-image-2.1",
        ("QwenImage21Pipeline",),
        COMPONENTS,
        sizes=(SizeMatch("text_encoder", "text_config.hidden_size", "context_in_dim", 4096),),
        single_file_example="qwen_image_2.1_bf16.safetensors",
    )
    model_class = "QwenImage21Transformer2DModel"
    single_file_markers = ("txt_in.text_norm.weight", "transformer_blocks.0.img_mlp.gate_layer.weight")
    single_file_name = "qwen_image_2.1_transformer.safetensors"
    lora_target_names = LINEARS
    # ComfyUI's key map takes the diffusers names under "transformer." for every linear (it fuses gate_layer and proj
    # into its img_mlp.gate_up itself, so "diffusion_model.<name>" would miss those two)
    comfy_takes_diffusers_names = True

    def original_layout(self, transformer_config: dict[str, Any]) -> KeyTable:
        """ComfyUI's layout: the diffusers names (optionally under ``model.diffusion_model.``)."""
        return comfy_layout("Qwen-Image 2.1 transformer")

    def lora_layout(self, state_dict: dict[str, torch.Tensor]) -> KeyTable:
        return self.original_layout({})

    @hookimpl
    def export_adapter(self, state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str) -> Any:
        """``diffusers``: peft keys under ``transformer.`` (alpha in the metadata); ``comfyui``: the same keys with a
        scalar ``.alpha`` per module, which ComfyUI's Qwen-Image key map loads (``transformer.<diffusers module>``,
        ``img_mlp.gate_layer`` / ``proj`` into its fused ``gate_up``) at the trained strength."""
        from diffpipe_core.adapters import diffusers_format, with_alpha
        from diffpipe_core.parts.export import lora_modules

        if format not in ("diffusers", "comfyui"):
            return None
        lora_modules(state_dict)  # refuses keys no layout carries
        keys = diffusers_format(state_dict, self.folder.model)
        return with_alpha(keys, alpha) if format == "comfyui" else keys

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: QwenImage21Config, device: torch.device) -> Any:
        """The VAE, and Qwen3-VL with its processor in a text-only ``QwenImage21Pipeline`` (its template, the system
        turn it drops, the last decoder layer's output before the final norm)."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline
        from diffpipe_core.parts.vl_processors import ImageOnlyQwen3VLProcessor, load_processor

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder")
        enc.processor = load_processor(model_config.path / "processor", ImageOnlyQwen3VLProcessor)
        enc.text = text_pipeline("QwenImage21Pipeline", text_encoder=enc.text_encoder, processor=enc.processor)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 64, H/16, W/16) of the image made opaque RGBA (the VAE reads four channels: the
        pipeline converts every image to RGBA), ``(z - latents_mean) / latents_std`` as the pipeline normalises image
        latents; ``mask`` on the latent grid when given. Captions: ``text_embeds`` (B, text_max_length, d) and
        ``text_mask`` (B, text_max_length): the pipeline's ``encode_prompt`` padded to the fixed length (the padding
        masked)."""
        import torch

        from diffpipe_core.parts.latents import latent_mask, normalize, vae_mode
        from diffpipe_core.parts.text import fixed_length

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            z = vae_mode(encoders.vae, with_alpha_channel(batch.pixels, encoders.vae), video=True)
            config = encoders.vae.config
            out["latents"] = normalize(z, config.latents_mean, config.latents_std)[:, :, 0].cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        if batch.captions is not None:
            length = encoders.config.text_max_length
            with torch.no_grad():
                embeds, mask, _ = encoders.text.encode_prompt(list(batch.captions), device=encoders.device)
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
            if embeds.shape[1] > length:
                log.warning("a caption's Qwen3-VL embedding has %d tokens; text_max_length keeps %d",
                            embeds.shape[1], length)
            embeds, mask = fixed_length(embeds.float().cpu(), mask.cpu(), length)
            out.update(text_embeds=embeds, text_mask=mask.long())
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: QwenImage21Config) -> list[nn.Module]:
        """Embedders (+ RoPE and the block-causal segments, computed once), each single-stream block, the final
        norm/projection."""
        from diffpipe_qwenimage import layers21

        return layers21.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, text_mask, shapes), (velocity[, mask]))``, the latent pixels flattened row-major as
        the pipeline packs them; rectified flow shifted as the pipeline's scheduler shifts for ``h * w`` tokens
        (``dynamic_shift``) or by ``shift``. The text is cut to the micro-batch's longest caption."""
        import torch

        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_qwenimage.plugin import training_shift

        cfg: QwenImage21Config = context.model_config  # type: ignore[assignment]
        b, c, h, w = batch["latents"].shape
        f = flow_sample(batch["latents"], cfg, context, generator, training_shift(cfg, h * w, SCHEDULER))
        text, mask = trimmed(batch["text_embeds"], batch["text_mask"])
        self.note_padding(mask)
        targets = with_mask((flat(f.target),), batch, lambda m: flat(m.expand(b, c, h, w)))
        return (flat(f.x_t), f.t, text, mask, torch.tensor([[1, h, w]])), targets

    def note_padding(self, mask: torch.Tensor) -> None:
        """Say once per process that a micro-batch held captions of different lengths: padded to the longest, as the
        pipeline pads a batch of prompts, which moves the image's positions behind the shorter ones."""
        if mask.shape[0] > 1 and not self.__dict__.get("_padding_noted") and not bool(mask.all()):
            self.__dict__["_padding_noted"] = True
            log.warning("qwen-image-2.1: captions of different lengths share a micro-batch and are padded to the "
                        "longest, which moves the image's positions behind the shorter ones; micro_batch_size_per_gpu "
                        "= 1 (with gradient_accumulation_steps) trains exactly what a single prompt samples")

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: QwenImage21Config, generator: torch.Generator):
        """Noise ``(1, C, H/16, W/16)`` drawn as the pipeline's ``prepare_latents`` draws it, and the sigmas its
        scheduler makes of the folder's ``sample_sigmas`` (the Turbo checkpoint's grid; else ``linspace(1, 1/steps,
        steps)``) for the image's token count."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        factor = 2 ** len(self.folder.config(model_config.path, "vae")["temperal_downsample"])
        c = int(self.model_folder_config(model_config)["in_channels"])
        h, w = 2 * (request.height // (factor * 2)), 2 * (request.width // (factor * 2))
        noise = torch.randn((1, 1, c, h, w), generator=generator)[:, 0]
        sigmas = self.sample_sigmas(model_config)
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps) if sigmas is None else np.asarray(sigmas)
        return noise, scheduler_flow_sigmas(model_config.path, sigmas, h * w)

    def sample_sigmas(self, model_config: QwenImage21Config) -> list[float] | None:
        """The folder's ``sample_sigmas`` (``model_index.json``: the pipeline's config), which replace the request's
        step count as they do the pipeline's ``num_inference_steps``; None where the folder has none."""
        from diffpipe_core.model_files import read_json

        index, _ = read_json(model_config.path / "model_index.json")
        return (index or {}).get("sample_sigmas")

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds, text_mask, shapes)`` at ``schedule[index]``."""
        import torch

        b, _, h, w = latents.shape
        # the pipeline hands the transformer its scheduler's timestep (sigma * 1000, float32) divided by 1000
        t = (schedule[index].float() * 1000 / 1000).expand(b)
        embeds, mask = trimmed(text["text_embeds"], text["text_mask"])
        return flat(latents.float()), t, embeds, mask, torch.tensor([[1, h, w]])

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return prediction.transpose(1, 2).reshape(latents.shape)

    @hookimpl
    def decode_latents(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """``latents * latents_std + latents_mean`` as one frame, the VAE's decoder; its RGB (of RGBA) in [-1, 1]."""
        import torch

        from diffpipe_core.parts.latents import per_channel

        with torch.no_grad():
            z = latents.float().unsqueeze(2)
            z = z * per_channel(decoder.config.latents_std, z) + per_channel(decoder.config.latents_mean, z)
            param = next(decoder.parameters())
            rgba = decoder.decode(z.to(param.device, param.dtype)).sample[:, :, 0]
            return rgba[:, :3].float().clamp(-1, 1)


def with_alpha_channel(pixels: torch.Tensor, vae: Any) -> torch.Tensor:
    """RGB in [-1, 1] as the opaque RGBA the pipeline hands its VAE (alpha 255 -> 1), when the VAE takes 4
    channels."""
    import torch

    if int(vae.config.in_channels) != 4 or pixels.shape[1] != 3:
        return pixels
    return torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)


def flat(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, h * w, C)``, as ``QwenImage21Pipeline._pack_latents`` lays the tokens out."""
    return latents.flatten(2).transpose(1, 2)


class QwenImage21Turbo(QwenImage21):
    """Qwen-Image 2.1 Turbo: the few-step checkpoint, sampled without guidance on its own ``sample_sigmas``
    (``QwenImage21TurboModularPipeline``). Trained like the base model; see the README for what to expect."""
    tiny_writer = "diffpipe_qwenimage.testing21:write_tiny_qwen21_turbo"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        QwenImage21.spec,
        name="qwen-image-2.1-turbo",
        config_schema=QwenImage21TurboConfig,
        description="Qwen-Image 2.1 Turbo (few-step, no guidance; diffusers folder or ComfyUI's single file)",
    )
    folder = replace(QwenImage21.folder, model_name="qwen-image-2.1-turbo",
                     single_file_example="qwen_image_2.1_turbo_bf16.safetensors")


plugin = QwenImage21()
turbo = QwenImage21Turbo()
