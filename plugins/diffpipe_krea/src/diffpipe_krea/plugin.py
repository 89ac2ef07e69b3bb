"""The Krea 2 model plugins (entry points ``krea2`` and ``krea2-turbo``) on the core's shared plugin parts.

Krea 2 is a single-stream transformer over the 2x2-packed latents of Qwen-Image's VAE (multiples of 16 pixels) and a
caption's Qwen3-VL hidden states tapped at 12 layers, which its own text-fusion stage merges. No torch import at the
top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling, FrameVAEDecoding
from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_krea.config import Krea2Config, Krea2TurboConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

log = logging.getLogger("diffpipe.krea")
COMPONENTS = {
    "transformer": "Krea2Transformer2DModel",
    "vae": "AutoencoderKLQwenImage",
    "text_encoder": "Qwen3VLModel",
    "tokenizer": TOKENIZER,
}
#: the linears of a block (single-stream and text-fusion blocks alike)
BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up", "ff.down")
#: the text layers' other linears, LoRA targets with ``lora_text_layers``
TEXT_LINEARS = ("text_fusion.projector", "txt_in.linear_1", "txt_in.linear_2")
#: Krea2Pipeline's scheduler settings where the folder's scheduler config has none (its docstring's Krea 2 values)
SCHEDULER = {"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 6400, "base_shift": 0.5,
             "max_shift": 1.15, "shift": 1.0, "time_shift_type": "exponential"}
#: the distilled (Turbo) checkpoint's fixed time shift mu
DISTILLED_MU = 1.15


class Krea2(DiffusersModel, FrameVAEDecoding, FlowSampling):
    """Krea 2 (Raw, the base checkpoint): text-fusion then single-stream blocks over ``[text, image]``; samples as
    ``Krea2Pipeline`` (its ``is_distilled`` config picks the fixed shift of the distilled checkpoint)."""
    #: the released size (Krea 2) for the GPU-fit table (diffpipe_core.engine.fit_table): diffusers'
    #: Krea2Transformer2DModel defaults, which are the release's transformer/config.json; the Qwen-Image VAE (16
    #: channels, 8x); the text model's 12 hidden layers of 2560 at text_max_length's default 512
    plan_size = {
        "transformer": {"in_channels": 64, "num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 48,
                        "num_key_value_heads": 12, "intermediate_size": 16384, "text_hidden_dim": 2560,
                        "num_text_layers": 12},
        "vae": {"z_dim": 16, "temperal_downsample": [False, True, True]},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True,
                      "time_shift_type": "exponential", "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
                      "max_image_seq_len": 8192, "shift": 1.0},
        "text": {"text_embeds": (512, 12, 2560), "text_mask": (512,)},
    }  # fmt: skip

    tiny_writer = "diffpipe_krea.testing:write_tiny_krea2"  # python -m diffpipe_core.testing.tiny_models
    spec = diffusers_spec(
        "krea2", Krea2Config,
        "Krea 2 (Raw) text-to-image (diffusers folder, or ComfyUI's single-file transformer over it)",
        contract=4, encoder_settings=("text_max_length",), block_layers=("BlockLayer",), spatial_multiple=16,
    )
    folder = DiffusersFolder(
        "krea2",
        ("Krea2Pipeline",),
        COMPONENTS,
        sizes=(SizeMatch("text_encoder", "text_config.hidden_size", "text_hidden_dim", 2560),),
        single_file_example="krea2_raw.safetensors",
        title="Krea 2",
        file_layouts={"vae": wan_vae_table},  # ComfyUI's qwen_image_vae.safetensors is in the Wan VAE's layout
        file_optional={"text_encoder": ("visual.",)},  # text encoding never runs the vision tower
    )
    model_class = "Krea2Transformer2DModel"
    key_tables = "diffpipe_krea.original"
    single_file_markers = ("txtfusion.projector.weight", "tproj.1.weight")
    single_file_name = "krea2_transformer.safetensors"
    file_config = {"num_layers": r"(?:^|\.)(?:blocks|transformer_blocks)\.(\d+)\."}
    lora_target_names = (*BLOCK_LINEARS, *TEXT_LINEARS)
    # ComfyUI's Krea 2 key map also takes transformer.<diffusers name> for every linear (LoKr/LoHa saved so)
    comfy_takes_diffusers_names = True
    # no sample_pipeline for the kit: Krea2Pipeline takes packed latents and its guidance_scale g is CFG at 1 + g;
    # tests/test_krea2_sampling.py compares the samples with it (and with the Turbo modular pipeline) instead
    #: the Turbo entry point samples with the distilled shift whatever the folder says
    distilled = False

    def default_lora_targets(self, model_config: Krea2Config) -> list[str]:
        """Every block's linears (the text-fusion blocks' too) and the text projection, or with ``lora_text_layers
        = false`` the transformer blocks' linears by full name."""
        if model_config.lora_text_layers:
            return list(self.lora_target_names)
        count = int(self.model_folder_config(model_config)["num_layers"])
        return [f"transformer_blocks.{i}.{name}" for i in range(count) for name in BLOCK_LINEARS]

    # ------------------------------------------------------------------------------------------ schedule
    def pipeline_config(self, model_config: Any) -> dict[str, Any]:
        """The folder's ``model_index.json`` (the pipeline's config: ``text_encoder_select_layers``,
        ``is_distilled``); empty where it has none."""
        file = Path(model_config.path) / "model_index.json"
        return json.loads(file.read_text()) if file.is_file() else {}

    def is_distilled(self, model_config: Any) -> bool:
        return self.distilled or bool(self.pipeline_config(model_config).get("is_distilled", False))

    def scheduler_settings(self, model_config: Any) -> dict[str, Any]:
        file = Path(model_config.path) / "scheduler" / "scheduler_config.json"
        return {**SCHEDULER, **(json.loads(file.read_text()) if file.is_file() else {})}

    def mu(self, model_config: Any, image_tokens: int) -> float:
        """The pipeline's time shift ``mu``: fixed for the distilled checkpoint, else ``calculate_shift`` of the
        image's token count with the scheduler's constants."""
        if self.is_distilled(model_config):
            return DISTILLED_MU
        s = self.scheduler_settings(model_config)
        slope = (s["max_shift"] - s["base_shift"]) / (s["max_image_seq_len"] - s["base_image_seq_len"])
        return image_tokens * slope + s["base_shift"] - slope * s["base_image_seq_len"]

    def training_shift(self, model_config: Any, image_tokens: int) -> float:
        """The shift of the training times: with ``dynamic_shift`` the one the pipeline's scheduler applies for
        ``image_tokens`` (``e^mu`` for its exponential time shift, ``mu`` for the linear one, its fixed ``shift``
        without dynamic shifting), else ``shift``."""
        import math

        if not model_config.dynamic_shift:
            return model_config.shift
        s = self.scheduler_settings(model_config)
        if not s["use_dynamic_shifting"]:
            return float(s["shift"])
        mu = self.mu(model_config, image_tokens)
        return math.exp(mu) if s["time_shift_type"] == "exponential" else mu

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: Krea2Config, device: torch.device) -> Any:
        """The VAE, and Qwen3-VL with its tokenizer in a text-only ``Krea2Pipeline`` (its template, the padding in the
        middle that takes no position, the tapped layers of the folder's ``text_encoder_select_layers``)."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        index = self.pipeline_config(model_config)
        enc.text = text_pipeline("Krea2Pipeline", text_encoder=enc.text_encoder, tokenizer=enc.tokenizer,
                                 text_encoder_select_layers=index.get("text_encoder_select_layers"),
                                 is_distilled=False, patch_size=index.get("patch_size", 2))
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 16, H/8, W/8), ``(z - latents_mean) / latents_std`` of the image as one frame, as the
        pipeline denormalises before decoding; ``mask`` on the latent grid. Captions: ``text_embeds`` (B,
        text_max_length, layers, d) and ``text_mask`` (B, text_max_length): the pipeline's ``encode_prompt`` at
        ``max_sequence_length = text_max_length`` with each caption's valid tokens moved to the front (the pipeline
        pads in the middle of its template; the padding is masked and text takes no rotary position, so the
        transformer's output is the same), bfloat16 when the encoder runs in it."""
        import torch

        from diffpipe_core.parts.latents import frame_vae_latents
        from diffpipe_core.parts.text import compacted

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out.update(frame_vae_latents(encoders.vae, batch.pixels, batch.masks))
        if batch.captions is not None:
            with torch.no_grad():
                embeds, mask = encoders.text.encode_prompt(
                    list(batch.captions), device=encoders.device, max_sequence_length=encoders.config.text_max_length
                )
            embeds, mask = compacted(embeds.cpu(), mask.cpu().bool())
            dtype = torch.bfloat16 if embeds.dtype == torch.bfloat16 else torch.float32
            out.update(text_embeds=embeds.to(dtype), text_mask=mask.long())
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: Krea2Config) -> list[nn.Module]:
        """Embedders (text fusion included; + the rotary table, computed once), each block, the final layer."""
        from diffpipe_krea import layers

        return layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text, text_mask, grid), (velocity[, mask]))``, packed 2x2 as the pipeline packs latents;
        rectified flow shifted as the pipeline's scheduler shifts (``dynamic_shift``) or by ``shift``. The text is cut
        to the micro-batch's longest caption (the rest is padding)."""
        import torch

        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_core.parts.latents import pack_2x2
        from diffpipe_core.parts.text import trimmed

        cfg: Krea2Config = context.model_config  # type: ignore[assignment]
        b, c, h, w = batch["latents"].shape
        f = flow_sample(batch["latents"], cfg, context, generator, self.training_shift(cfg, (h // 2) * (w // 2)))
        text, mask = trimmed(batch["text_embeds"], batch["text_mask"])
        targets = with_mask((pack_2x2(f.target),), batch, lambda m: pack_2x2(m.expand(b, c, h, w).contiguous()))
        return (pack_2x2(f.x_t), f.t, text, mask, torch.tensor([h // 2, w // 2])), targets

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: Krea2Config, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` drawn as the pipeline's ``prepare_latents`` draws it, and the sigmas its
        scheduler makes of ``linspace(1, 1/steps, steps)`` at the pipeline's ``mu``."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        factor = 2 ** len(self.folder.config(model_config.path, "vae")["temperal_downsample"])
        c = int(self.model_folder_config(model_config)["in_channels"]) // 4
        h, w = 2 * (request.height // (factor * 2)), 2 * (request.width // (factor * 2))
        noise = torch.randn((1, c, h, w), generator=generator)
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        tokens = (h // 2) * (w // 2)
        return noise, scheduler_flow_sigmas(model_config.path, sigmas, tokens, self.mu(model_config, tokens))

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text, text_mask, grid)`` at ``schedule[index]``."""
        import torch

        from diffpipe_core.parts.latents import pack_2x2
        from diffpipe_core.parts.text import trimmed

        b, _, h, w = latents.shape
        # the pipeline hands the transformer its scheduler's timestep (sigma * 1000, float32) divided by 1000
        t = (schedule[index].float() * 1000 / 1000).expand(b)
        embeds, mask = trimmed(text["text_embeds"], text["text_mask"])
        return pack_2x2(latents.float()), t, embeds, mask, torch.tensor([h // 2, w // 2])

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        from diffpipe_core.parts.latents import unpack_2x2

        return unpack_2x2(prediction, latents.shape[-2], latents.shape[-1])


class Krea2Turbo(Krea2):
    """Krea 2 Turbo: the few-step distilled checkpoint, sampled without guidance at the fixed shift ``mu = 1.15``
    (``Krea2TurboModularPipeline``, 8 steps). Trained like Raw; see the README for what to expect."""

    tiny_writer = "diffpipe_krea.testing:write_tiny_krea2_turbo"
    spec = replace(
        Krea2.spec,
        name="krea2-turbo",
        config_schema=Krea2TurboConfig,
        description="Krea 2 Turbo (few-step, no guidance; diffusers folder or ComfyUI's single file)",
    )
    folder = replace(Krea2.folder, model_name="krea2-turbo", single_file_example="krea2_turbo.safetensors")
    distilled = True


plugin = Krea2()
turbo = Krea2Turbo()
