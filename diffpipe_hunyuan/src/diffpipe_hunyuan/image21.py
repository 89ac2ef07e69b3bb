"""The HunyuanImage-2.1 model plugin (entry point ``hunyuan-image-2.1``) on the core's shared plugin parts.

HunyuanImage-2.1 is HunyuanVideo's double- and single-stream transformer over an image's latents from a 32x VAE (64
channels, patch 1: sizes in multiples of 32 pixels), conditioned on Qwen2.5-VL's hidden states (third from last) and
the glyph ByT5 encoding of a caption's quoted text. The guidance-distilled checkpoint adds a guidance embedding and
MeanFlow's second time; its transformer config says so, and training and samples follow it. No torch import at the
top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import present
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_hunyuan.config import HunyuanImage21Config
from diffpipe_hunyuan.plugin import FILE_SIZES, block_linears
from diffpipe_hunyuan.vae_layouts import vae21_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "HunyuanImageTransformer2DModel",
    "vae": "AutoencoderKLHunyuanImage",
    "text_encoder": "Qwen2_5_VLForConditionalGeneration",
    "text_encoder_2": "T5EncoderModel",
    "tokenizer": TOKENIZER,
    "tokenizer_2": TOKENIZER,
}
TEXT_KEYS = ("text_embeds", "text_mask", "glyph_embeds", "glyph_mask")
#: the guider of a folder without one (the distilled checkpoint's): none, as the pipeline's disabled default
APG = "AdaptiveProjectedMixGuidance"
#: per sample being denoised (its schedule's id): the running average of ``cond - uncond`` the APG guider keeps
MOMENTUM: dict[int, Any] = {}
#: per sample being denoised: whether its prompt has glyph text (the pipeline then guides with its ``ocr_guider``)
GLYPH: dict[int, bool] = {}


class HunyuanImage21(DiffusersModel, FlowSampling):
    """HunyuanImage-2.1 text-to-image (base or guidance-distilled): VAE 32x, patch 1 = multiples of 32 pixels."""

    #: the released size (HunyuanImage-2.1, 17 B) for the GPU-fit table (diffpipe_core.engine.fit_table): the
    #: transformer/config.json of hunyuanvideo-community/HunyuanImage-2.1-Diffusers (20 double, 40 single blocks of
    #: 28 x 128); its VAE (64 channels, 32x: 6 levels); Qwen2.5-VL-7B's 3584-wide states at text_max_length 1000 and
    #: ByT5-small's 1472-wide glyph states at 128
    plan_size = {
        "transformer": {"in_channels": 64, "out_channels": 64, "num_attention_heads": 28, "attention_head_dim": 128,
                        "num_layers": 20, "num_single_layers": 40, "num_refiner_layers": 2, "mlp_ratio": 4.0,
                        "patch_size": [1, 1], "qk_norm": "rms_norm", "guidance_embeds": False,
                        "text_embed_dim": 3584, "text_embed_2_dim": 1472, "rope_theta": 256.0,
                        "rope_axes_dim": [64, 64], "use_meanflow": False},
        "vae": {"latent_channels": 64, "block_out_channels": [128, 256, 512, 512, 1024, 1024],
                "spatial_compression_ratio": 32},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 5.0},
        "text": {"text_embeds": (1000, 3584), "text_mask": (1000,), "glyph_embeds": (128, 1472), "glyph_mask": (128,)},
    }  # fmt: skip
    plan_resolutions = [(1024, 1024, 1), (2048, 2048, 1)]
    tiny_writer = "diffpipe_hunyuan.testing21:write_tiny_hunyuan_image"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "hunyuan-image-2.1", HunyuanImage21Config,
        "HunyuanImage-2.1 text-to-image, base or distilled (diffusers folder, Tencent's or ComfyUI's single file)",
        block_layers=("DoubleBlockLayer", "SingleBlockLayer"), spatial_multiple=32,
        encoder_settings=("text_max_length", "glyph_max_length"),
    )
    folder = DiffusersFolder(
        "hunyuan-image-2.1",
        ("HunyuanImagePipeline",),
        COMPONENTS,
        sizes=(
            SizeMatch("text_encoder", "text_config.hidden_size", "text_embed_dim", 3584),
            SizeMatch("text_encoder_2", "d_model", "text_embed_2_dim", 1472),
        ),
        file_layouts={"vae": vae21_table},
        single_file_example="hunyuanimage2.1.safetensors",
        title="HunyuanImage-2.1",
    )
    model_class = "HunyuanImageTransformer2DModel"
    key_tables = "diffpipe_hunyuan.original21"
    single_file_markers = ("double_blocks.0.img_attn_qkv.weight", "byt5_in.fc1.weight")
    single_file_name = "hunyuan_image_2.1_transformer.safetensors"
    file_config = {  # block counts, width and flags from the file itself (Tencent's, ComfyUI's or diffusers' names)
        **FILE_SIZES,
        "guidance_embeds": present("guidance_in", "time_guidance_embed.guidance_embedder"),
        "use_meanflow": present("time_r_in", "time_guidance_embed.timestep_embedder_r"),
    }
    encoder_components = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")

    def default_lora_targets(self, model_config: HunyuanImage21Config) -> list[str]:
        """Every linear of the double- and single-stream blocks (attention, MLP, modulation), by full name: the token
        refiner and the final layer use the same short names and are not adapted."""
        return block_linears(self.model_folder_config(model_config))

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: HunyuanImage21Config, device: torch.device) -> Any:
        """The VAE, Qwen2.5-VL and ByT5 with their tokenizers, the text encoders in a ``HunyuanImagePipeline`` holding
        only them, so the template, its 34 dropped tokens, the hidden state (third from last), the glyph-text
        extraction and the masks are the pipeline's; its lengths are the ``[model]`` ones."""
        from diffpipe_core.parts.text import text_pipeline

        enc = super().load_encoders(model_config, device)
        text = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
        enc.text = text_pipeline("HunyuanImagePipeline", **{n: getattr(enc, n) for n in text})
        enc.text.tokenizer_max_length = model_config.text_max_length
        enc.text.tokenizer_2_max_length = model_config.glyph_max_length
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, H/32, W/32), the VAE posterior's mode times its ``scaling_factor`` (the pipeline
        decodes ``latents / scaling_factor``), ``mask`` on the latent grid. Captions: ``text_embeds`` (B,
        text_max_length, d), ``text_mask``, ``glyph_embeds`` (B, glyph_max_length, d2), ``glyph_mask``: the
        pipeline's ``encode_prompt`` (bfloat16 embeddings where the encoders run in it)."""
        import torch

        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = shift_and_scale(vae_mode(encoders.vae, batch.pixels), encoders.vae.config).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape).cpu()
        if batch.captions is not None:
            with torch.no_grad():
                captions = list(batch.captions)
                found = encoders.text.encode_prompt(captions, device=encoders.device, batch_size=len(captions))
            for key, value in zip(TEXT_KEYS, found, strict=True):
                keep = torch.bfloat16 if value.dtype == torch.bfloat16 else torch.float32
                out[key] = (value.long() if key.endswith("mask") else value.to(keep)).cpu()
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: HunyuanImage21Config) -> list[nn.Module]:
        """Embedders and the joint text sequence (+ the rotary embedding, computed once), each double block, each
        single block, the final norm/projection (``layers21.py``)."""
        from diffpipe_hunyuan import layers21

        return layers21.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, text_mask, glyph_embeds, glyph_mask, guidance, t_r), (velocity[, mask]))``:
        rectified flow with the ``[model]`` time options; ``guidance`` is ``[model] guidance`` (read by a distilled
        transformer only), ``t_r = t`` (MeanFlow's average velocity over an empty interval is the velocity). The text
        is cut to the micro-batch's longest caption (the rest is masked padding)."""
        import torch

        from diffpipe_core.parts.flow import flow_sample, with_mask

        cfg: HunyuanImage21Config = context.model_config  # type: ignore[assignment]
        f = flow_sample(batch["latents"], cfg, context, generator)
        guidance = torch.full_like(f.t, float(cfg.guidance))
        return (f.x_t, f.t, *self.text_inputs(batch), guidance, f.t), with_mask((f.target,), batch)

    @staticmethod
    def text_inputs(text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``(text_embeds, text_mask, glyph_embeds, glyph_mask)``: each cut to its longest row (at least one token),
        embeddings float, masks bool."""
        from diffpipe_core.parts.text import trimmed

        embeds, mask = trimmed(text["text_embeds"], text["text_mask"])
        glyph, glyph_mask = trimmed(text["glyph_embeds"], text["glyph_mask"])
        return embeds.float(), mask, glyph.float(), glyph_mask

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: HunyuanImage21Config, generator: torch.Generator):
        """Noise ``(1, C, H/32, W/32)`` as the pipeline's ``prepare_latents`` draws it and the folder's scheduler
        sigmas of ``linspace(1, 0, steps + 1)[:-1]``, as the pipeline makes them."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        sigmas = np.linspace(1.0, 0.0, request.steps + 1)[:-1]
        noise = torch.randn(self.latent_shape(request, model_config), generator=generator)
        return noise, scheduler_flow_sigmas(self.model_folder(model_config), sigmas)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds, text_mask, glyph_embeds, glyph_mask, guidance, t_r)``: ``t`` the
        step's sigma, ``t_r`` the next one (0 after the last step), as the pipeline gives a MeanFlow transformer;
        ``guidance`` ``[sample] guidance`` or ``[model] guidance``."""
        import torch

        b = latents.shape[0]
        t = schedule[index].float().expand(b)
        t_r = schedule[index + 1].float().expand(b)
        guidance = model_config.guidance if request.guidance is None else request.guidance
        # the loop hands a sample's prompt after its negative one (alone or as the batch's last row): what the
        # pipeline's choice of guider looks at
        GLYPH[id(schedule)] = bool(text["glyph_mask"][-1].any())
        return latents.float(), t, *self.text_inputs(text), torch.full((b,), float(guidance)), t_r

    def guider_config(self, model_config: HunyuanImage21Config, ocr: bool = False) -> dict[str, Any]:
        """The folder's guider (``guider/guider_config.json``, the base checkpoint's ``AdaptiveProjectedMixGuidance``;
        with ``ocr`` its ``ocr_guider/`` where it has one, which the pipeline takes for a prompt with quoted text);
        empty where it has none (the distilled checkpoint: no guidance)."""
        folder = Path(self.model_folder(model_config))
        for name in ("ocr_guider", "guider") if ocr else ("guider",):
            file = folder / name / "guider_config.json"
            if file.is_file():
                return json.loads(file.read_text())
        return {}

    @hookimpl
    def combine_guidance(self, uncond, cond, scale, schedule, index, model_config):
        """As the folder's guider combines them (its ``ocr_guider`` for a prompt with quoted text, as the pipeline
        picks it): ``AdaptiveProjectedMixGuidance`` is CFG at ``[sample] cfg`` up to its
        ``adaptive_projected_guidance_start_step``, then adaptive projected guidance with its own scale, momentum and
        norm threshold (the momentum follows every step); without a guider, CFG."""
        from diffpipe_hunyuan.guidance import apg_mix

        key = id(schedule)  # one per sample: the loop denoises several samples side by side
        config = self.guider_config(model_config, ocr=GLYPH.get(key, False))
        if index == 0:
            MOMENTUM.pop(key, None)
        if config.get("_class_name") != APG:
            combined = uncond + scale * (cond - uncond)
        else:
            combined, MOMENTUM[key] = apg_mix(uncond, cond, scale, index, config, MOMENTUM.get(key))
        if index == len(schedule) - 2:  # the sample's last step: nothing of it is kept
            MOMENTUM.pop(key, None)
            GLYPH.pop(key, None)
        return combined


plugin = HunyuanImage21()
