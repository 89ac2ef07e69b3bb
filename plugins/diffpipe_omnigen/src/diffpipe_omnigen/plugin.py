"""The OmniGen2 model plugin (entry point ``omnigen2``) on the core's shared plugin parts.

OmniGen2 is not in diffusers: its transformer is this plugin's own (:mod:`diffpipe_omnigen.model`, checked against
the reference implementation's outputs). No torch import at the top (``diffpipe --help``, ``models``, ``validate``
load every plugin): hooks import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_omnigen.config import OmniGen2Config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

MODEL = "diffpipe_omnigen.model:OmniGen2Transformer2DModel"
COMPONENTS = {  # the released folder's model_index.json (OmniGen2/OmniGen2)
    "transformer": MODEL,
    "vae": "AutoencoderKL",
    "mllm": "Qwen2_5_VLForConditionalGeneration",
    "processor": TOKENIZER,  # Qwen2.5-VL's processor folder: its tokenizer and chat template are what captions need
}
BLOCK_GROUPS = ("context_refiner", "noise_refiner", "layers")  # what a text-to-image step runs
X_EMBEDDER = weight_of("x_embedder")
HEAD_DIM = Shape(weight_of("layers.0.attn.norm_q"), 0)  # a per-head RMS norm


class OmniGen2(DiffusersModel, FlowSampling):
    """OmniGen2: a Lumina-2 style single-stream DiT with caption, noise and reference-image refiners on Qwen2.5-VL
    text features; FLUX.1's VAE (factor 8) x 2x2 patches = multiples of 16 pixels. Trains text-to-image."""

    #: the released size for the GPU-fit table (diffpipe_core.engine.fit_table): OmniGen2/OmniGen2's
    #: transformer/config.json (the reference's options/ft.yml arch_opt); FLUX.1's VAE; Qwen2.5-VL-3B's 2048-wide
    #: last hidden state, text_max_length's default 256
    plan_size = {
        "transformer": {"patch_size": 2, "in_channels": 16, "hidden_size": 2520, "num_layers": 32,
                        "num_refiner_layers": 2, "num_attention_heads": 21, "num_kv_heads": 7, "multiple_of": 256,
                        "norm_eps": 1e-05, "axes_dim_rope": [40, 40, 40], "axes_lens": [10000, 10000, 10000],
                        "text_feat_dim": 2048, "timestep_scale": 1000.0},
        "vae": {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512]},
        "text": {"text_embeds": (256, 2048), "text_mask": (256,)},
    }  # fmt: skip

    tiny_writer = "diffpipe_omnigen.testing:write_tiny_omnigen2"  # python -m diffpipe_core.testing.tiny_models
    spec = diffusers_spec(
        "omnigen2", OmniGen2Config, "OmniGen2 text-to-image (its own transformer; released folder or ComfyUI files)",
        encoder_settings=("text_max_length", "system_prompt"),
        block_layers=("ContextRefinerLayer", "NoiseRefinerLayer", "MainLayer"),
    )
    folder = DiffusersFolder(
        "omnigen2",
        ("OmniGen2Pipeline",),
        COMPONENTS,
        sizes=(SizeMatch("mllm", "hidden_size", "text_feat_dim", 2048),),
        single_file_example="omnigen2_fp16.safetensors",
        title="OmniGen2",
        text_encoders=("mllm",),  # [model] text_encoders: ComfyUI's qwen_2.5_vl_fp16.safetensors
    )
    model_class = MODEL
    encoder_components = ("vae", "mllm", "processor")
    single_file_markers = ("layers.0.attn.to_q.weight", "ref_image_patch_embedder.weight")
    single_file_name = "omnigen2_transformer.safetensors"
    key_tables = "diffpipe_omnigen.original"  # the same names: the single_file export and the ComfyUI LoRA
    file_config = {  # block counts and widths from the file itself
        "num_layers": blocks("layers"),
        "num_refiner_layers": blocks("noise_refiner"),
        "hidden_size": Shape(X_EMBEDDER, 0),
        "num_attention_heads": Shape(X_EMBEDDER, 0, per=HEAD_DIM),
        "text_feat_dim": Shape(weight_of("time_caption_embed.caption_embedder.1"), 1),
    }
    lora_target_names = (  # every block's attention and feed-forward linears, and the adaLN linear where modulated
        *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"),
        *("feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3", "norm1.linear"),
    )

    def default_lora_targets(self, model_config: OmniGen2Config) -> list[str]:
        """:attr:`lora_target_names` in the blocks a text-to-image step runs (context, noise refiners, main blocks),
        by full name: the reference-image refiner's blocks share the names and would get no gradient."""
        config = self.model_folder_config(model_config)
        counts = {"context_refiner": config.get("num_refiner_layers", 2), "noise_refiner": config.get(
            "num_refiner_layers", 2), "layers": config.get("num_layers", 32)}
        return [
            f"{group}.{i}.{name}"
            for group in BLOCK_GROUPS
            for i in range(int(counts[group]))
            for name in self.lora_target_names
            if not (group == "context_refiner" and name == "norm1.linear")  # unmodulated: norm1 is an RMSNorm
        ]

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 16, H/8, W/8) as ``(mode - shift_factor) * scaling_factor`` (FLUX.1's VAE), ``mask``
        on the latent grid. Captions (and a sample's negative prompt, as the pipeline encodes it): ``text_embeds``
        (B, text_max_length, d), Qwen2.5-VL's last hidden state of the chat-templated caption, and ``text_mask``."""
        from diffpipe_core.parts.latents import image_vae_latents
        from diffpipe_omnigen.text import encode_prompts

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out.update(image_vae_latents(encoders.vae, batch.pixels, batch.masks))
        if batch.captions is not None:
            cfg = encoders.config
            embeds, mask = encode_prompts(encoders.mllm, encoders.processor, list(batch.captions), cfg.system_prompt,
                                          cfg.text_max_length, padding="max_length")
            out["text_embeds"], out["text_mask"] = embeds.float().cpu(), mask.long().cpu()
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: OmniGen2Config) -> list[nn.Module]:
        """Embedders, each context-refiner, noise-refiner and main block, the output head (``layers.py``)."""
        from diffpipe_omnigen.layers import split_into_layers

        return split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, 1 - t, text_embeds, text_mask), (velocity[, mask]))``: rectified flow with ``t`` = 1 at the
        noise (the transformer takes OmniGen2's time ``1 - t``), logit-normal times shifted by the image's patch count
        as the reference's ``dynamic_time_shift`` (or by ``shift`` with ``flux_shift = false``)."""
        from diffpipe_core.diffusion import flux_resolution_shift
        from diffpipe_core.parts.flow import flow_sample, with_mask

        cfg = context.model_config
        h, w = batch["latents"].shape[-2:]
        shift = flux_resolution_shift((h // 2) * (w // 2)) if cfg.flux_shift else cfg.shift
        f = flow_sample(batch["latents"], cfg, context, generator, shift=shift)
        inputs = (f.x_t, 1 - f.t, batch["text_embeds"].float(), batch["text_mask"].long())
        return inputs, with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: OmniGen2Config, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` and OmniGen2's schedule in its own time (0 = noise): its scheduler's
        ``linspace(0, 1, steps + 1)[:-1]``, shifted by ``m = sqrt(h * w) / 40`` when the folder's scheduler has
        ``dynamic_time_shift`` (the released one has), then a final 1."""
        import torch

        from diffpipe_omnigen.text import omnigen_times

        shape = self.latent_shape(request, model_config)
        scheduler = self.folder_scheduler_config(model_config)
        times = omnigen_times(request.steps, shape[-2] * shape[-1], scheduler.get("dynamic_time_shift", True))
        return torch.randn(shape, generator=generator), times

    def folder_scheduler_config(self, model_config: OmniGen2Config) -> dict[str, Any]:
        """``scheduler/scheduler_config.json`` of the folder (empty when it has none)."""
        from diffpipe_core.model_files import read_json

        found, _ = read_json(self.model_folder(model_config) / "scheduler" / "scheduler_config.json")
        return found or {}

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds, text_mask)``; ``t`` the schedule's time (0 = noise)."""
        t = schedule[index].float().expand(latents.shape[0])
        return latents.float(), t, text["text_embeds"].float(), text["text_mask"].long()

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """OmniGen2's scheduler step in its time: ``x + (t_next - t) * v`` with its velocity ``v = -prediction``."""
        dt = (schedule[index + 1] - schedule[index]).float()
        return latents.float() + dt * (-prediction.float().to(latents.device))


plugin = OmniGen2()
