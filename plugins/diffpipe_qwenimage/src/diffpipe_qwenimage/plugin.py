"""The Qwen-Image model plugin (entry point ``qwen-image``) on the core's shared plugin parts.

No torch import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling, FrameVAEDecoding
from diffpipe_core.parts.targets import JOINT_ATTENTION
from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_qwenimage.config import QwenImageConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.parts.layout import KeyTable
    from diffpipe_core.types import SampleRequest

LINEARS = (*JOINT_ATTENTION, "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
PIPELINES = ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")
COMPONENTS = {
    "transformer": "QwenImageTransformer2DModel",
    "vae": "AutoencoderKLQwenImage",
    "text_encoder": "Qwen2_5_VLForConditionalGeneration",
    "tokenizer": TOKENIZER,
}
SIZES = (SizeMatch("text_encoder", "hidden_size", "joint_attention_dim", 3584),)
#: original layouts of component files: ComfyUI's qwen_image_vae.safetensors is in the Wan VAE's
FILE_LAYOUTS = {"vae": wan_vae_table}
#: QwenImagePipeline's scheduler settings, for a folder without scheduler/scheduler_config.json
SCHEDULER = {"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5,
             "max_shift": 0.9, "shift": 1.0, "time_shift_type": "exponential"}


class QwenImage(DiffusersModel, FrameVAEDecoding, FlowSampling):
    """Qwen-Image: an MMDiT over 2x2-packed latents of a VAE with 8x compression (sizes in multiples of 16 pixels),
    conditioned on Qwen2.5-VL's last hidden state of the chat-templated caption."""
    #: the released size (Qwen-Image, 20 B) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: Qwen/Qwen-Image's transformer/config.json (= diffusers' QwenImageTransformer2DModel defaults); its VAE (16
    #: channels, 8x); Qwen2.5-VL-7B (3584) at text_max_length's default 512
    plan_size = {
        "transformer": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                        "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                        "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]},
        "vae": {"z_dim": 16, "temperal_downsample": [False, True, True]},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True,
                      "time_shift_type": "exponential", "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
                      "max_image_seq_len": 8192, "shift": 1.0},
        "text": {"text_embeds": (512, 3584), "text_mask": (512,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_qwenimage.testing:write_tiny_qwen"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "qwen-image", QwenImageConfig,
        "Qwen-Image text-to-image (diffusers folder, or ComfyUI's single-file transformer over it)",
        contract=4, encoder_settings=("text_max_length",), block_layers=("BlockLayer",),
    )
    folder = DiffusersFolder(
        "qwen-image",
        PIPELINES,
        COMPONENTS,
        sizes=SIZES,
        single_file_example="qwen_image_bf16.safetensors",
        file_layouts=FILE_LAYOUTS,
    )
    model_class = "QwenImageTransformer2DModel"
    single_file_markers = ("txt_norm.weight", "transformer_blocks.0.img_mod.1.weight")
    single_file_name = "qwen_image_transformer.safetensors"
    file_config = {  # block count and widths from the file itself
        "num_layers": blocks("transformer_blocks"),
        "num_attention_heads": Shape(weight_of("img_in"), 0, per="attention_head_dim"),
        "in_channels": Shape(weight_of("img_in"), 1),
        "joint_attention_dim": Shape(weight_of("txt_in"), 1),
    }
    lora_target_names = LINEARS
    # the last block's text stream feeds nothing: its text queries, text attention output and text MLP
    last_block_unused = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")

    def original_layout(self, transformer_config: dict[str, Any]) -> KeyTable:
        """ComfyUI's layout: the diffusers names (optionally under ``model.diffusion_model.``)."""
        return comfy_layout("Qwen-Image transformer")

    def lora_layout(self, state_dict: dict[str, torch.Tensor]) -> KeyTable:
        return self.original_layout({})

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: QwenImageConfig, device: torch.device) -> Any:
        """The VAE, and Qwen2.5-VL with its tokenizer in a text-only ``QwenImagePipeline`` (its own template, the 34
        template tokens it drops, the last hidden state)."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.text = text_pipeline("QwenImagePipeline", text_encoder=enc.text_encoder, tokenizer=enc.tokenizer)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media (and control images): ``latents`` (B, C, H/8, W/8), ``(z - latents_mean) / latents_std`` as the
        edit pipelines normalise their image latents; ``mask`` on the latent grid when given. Captions:
        ``text_embeds`` (B, text_max_length, d) and ``text_mask`` (B, text_max_length), the pipeline's
        ``encode_prompt`` padded to the fixed length (the padding masked)."""
        from diffpipe_core.parts.latents import frame_vae_latents

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out.update(frame_vae_latents(encoders.vae, batch.pixels, batch.masks))
        if batch.captions is not None:
            embeds, mask = self.encode_text(encoders, batch)
            out.update(text_embeds=embeds.cpu(), text_mask=mask.long().cpu())
        return out

    def encode_text(self, encoders: Any, batch: EncodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeds, mask)`` of the captions at the fixed length, from the pipeline's own ``encode_prompt``."""
        import torch

        from diffpipe_core.parts.text import fixed_length

        length = encoders.config.text_max_length
        with torch.no_grad():
            embeds, mask = encoders.text.encode_prompt(
                batch.captions, device=encoders.device, max_sequence_length=length
            )
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        return fixed_length(embeds.float().cpu(), mask.cpu(), length)

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: QwenImageConfig) -> list[nn.Module]:
        """Embedders (+ RoPE, computed once), each dual-stream block, final norm/projection."""
        from diffpipe_qwenimage import layers

        return layers.split_into_layers(model)

    def image_tokens(self, tokens: torch.Tensor, hw: tuple[int, int], source: dict[str, torch.Tensor]):
        """The first layer's image tokens and ``img_shapes`` (``(K, 3)`` int): the packed target alone here; the
        edit model appends its reference images."""
        import torch

        return tokens, torch.tensor([[1, hw[0] // 2, hw[1] // 2]])

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, text_mask, shapes), (velocity[, mask]))``, packed 2x2; rectified flow
        (:func:`diffpipe_core.parts.flow.flow_sample`) shifted as the pipeline's scheduler shifts (``dynamic_shift``)
        or by ``shift``. The text is cut to the micro-batch's longest caption (the rest is padding)."""
        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_core.parts.latents import pack_2x2

        cfg: QwenImageConfig = context.model_config  # type: ignore[assignment]
        b, c, h, w = batch["latents"].shape
        f = flow_sample(batch["latents"], cfg, context, generator, training_shift(cfg, (h // 2) * (w // 2)))
        x, shapes = self.image_tokens(pack_2x2(f.x_t), (h, w), batch)
        text, mask = trimmed(batch["text_embeds"], batch["text_mask"])
        targets = with_mask((pack_2x2(f.target),), batch, lambda m: pack_2x2(m.expand(b, c, h, w).contiguous()))
        return (x, f.t, text, mask, shapes), targets

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: QwenImageConfig, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` drawn as the pipeline's ``prepare_latents`` draws it, and the sigmas its
        scheduler makes of ``linspace(1, 1/steps, steps)`` for the image's token count (dynamic shift and
        ``shift_terminal`` included)."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        factor = 2 ** len(self.folder.config(model_config.path, "vae")["temperal_downsample"])
        c = int(self.model_folder_config(model_config)["in_channels"]) // 4
        h, w = 2 * (request.height // (factor * 2)), 2 * (request.width // (factor * 2))
        noise = torch.randn((1, 1, c, h, w), generator=generator)[:, 0]
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        return noise, scheduler_flow_sigmas(model_config.path, sigmas, (h // 2) * (w // 2))

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds, text_mask, shapes)`` at ``schedule[index]``."""
        from diffpipe_core.parts.latents import pack_2x2

        b, _, h, w = latents.shape
        x, shapes = self.image_tokens(pack_2x2(latents.float()), (h, w), text)
        # the pipeline hands the transformer its scheduler's timestep (sigma * 1000, float32) divided by 1000
        t = (schedule[index].float() * 1000 / 1000).expand(b)
        embeds, mask = trimmed(text["text_embeds"], text["text_mask"])
        return x, t, embeds, mask, shapes

    @hookimpl
    def combine_guidance(self, uncond, cond, scale, schedule, index, model_config):
        """The pipelines' true CFG: the plain combination rescaled to the norm of ``cond`` per token."""
        combined = uncond + scale * (cond - uncond)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        from diffpipe_core.parts.latents import unpack_2x2

        return unpack_2x2(prediction, latents.shape[-2], latents.shape[-1])


def comfy_layout(model: str) -> KeyTable:
    """The layout of ComfyUI's Qwen-Image files: the diffusers names (optionally under ``model.diffusion_model.``)."""
    from diffpipe_core.parts.layout import KeyTable

    return KeyTable((), name="ComfyUI", model=model, passthrough=True)


def trimmed(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached text cut to the longest caption among ``mask``'s rows (the core's
    :func:`~diffpipe_core.parts.text.trimmed`), in float32."""
    from diffpipe_core.parts.text import trimmed as cut

    embeds, mask = cut(embeds, mask)
    return embeds.float(), mask


@functools.lru_cache(maxsize=16)
def _scheduler_file(path: Path) -> dict[str, Any]:
    file = Path(path) / "scheduler" / "scheduler_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def scheduler_settings(path: Path, defaults: dict[str, Any] = SCHEDULER) -> dict[str, Any]:
    """The folder's ``scheduler/scheduler_config.json`` over ``defaults`` (Qwen-Image's :data:`SCHEDULER`)."""
    return {**defaults, **_scheduler_file(Path(path))}


def training_shift(cfg: Any, image_tokens: int, defaults: dict[str, Any] = SCHEDULER) -> float:
    """The time shift of training: with ``dynamic_shift`` the one the pipeline's scheduler applies to its sigmas for
    ``image_tokens`` (``mu`` linear in the token count; the exponential time shift is the shift ``e^mu``, the linear
    one the shift ``mu``), else ``shift``. ``defaults``: the pipeline's scheduler settings where the folder's
    scheduler config has none."""
    import math

    from diffpipe_core.diffusion import flux_resolution_shift

    if not cfg.dynamic_shift:
        return cfg.shift
    s = scheduler_settings(cfg.path, defaults)
    if not s["use_dynamic_shifting"]:
        return float(s["shift"])
    keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
    shift = flux_resolution_shift(image_tokens, *(s[k] for k in keys))  # e^mu
    return shift if s["time_shift_type"] == "exponential" else math.log(shift)


plugin = QwenImage()
