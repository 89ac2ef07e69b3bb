"""The Cosmos model plugins on the core's shared plugin parts: ``cosmos`` (Cosmos-1.0 Diffusion text-to-world, EDM)
and ``cosmos-predict2`` (Cosmos-Predict2 text-to-image and video, rectified flow), one class each on a shared base.

Both use diffusers' ``CosmosTransformer3DModel`` and T5; 1.0 with ``AutoencoderKLCosmos``, Predict2 with
``AutoencoderKLWan``. Both sample as their pipelines do: from noise at ``sigma_max`` down Karras et al.'s noise
levels with the EDM Euler step, 1.0 through the EDM preconditioning (``CosmosTextToWorldPipeline``), Predict2 with
``t = sigma / (1 + sigma)`` (``Cosmos2TextToImagePipeline``; its video-to-world loop for videos, without conditioning
frames). The pipelines' ``guidance_scale`` s is ``[sample] cfg`` = 1 + s (they form ``cond + s * (cond - uncond)``).
``[model] conditioning = "video"``: video-to-world, as ``CosmosVideoToWorldPipeline`` / ``Cosmos2VideoToWorldPipeline``
(:mod:`diffpipe_cosmos.conditioning`, :mod:`diffpipe_cosmos.video2world`).
This module imports no torch, diffusers or transformers; each hook imports what does the work when it is called.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, ClassVar

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_cosmos.conditioning import VideoToWorld
from diffpipe_cosmos.config import Cosmos1Config, CosmosConfigBase, Predict2Config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.parts.layout import KeyTable
    from diffpipe_core.types import SampleRequest
    from diffpipe_cosmos.nvidia import Variant

log = logging.getLogger("diffpipe.cosmos")
#: attention (self and cross) and MLP linears of every block; the adaLN modulation linears are left alone
LORA_TARGETS = tuple(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0"))
LORA_TARGETS += ("ff.net.0.proj", "ff.net.2")
SIZES_720P = {(704, 1280), (1280, 704), (960, 960), (704, 960), (960, 704)}  # (height, width) of the releases
# EDMEulerScheduler's defaults; the Predict2 pipelines set theirs over the scheduler's config
EDM_DEFAULTS = {"sigma_min": 0.002, "sigma_max": 80.0, "rho": 7.0, "final_sigmas_type": "zero"}


def _folder(name: str, pipelines: tuple[str, ...], vae: str, layouts: dict[str, Any] | None = None) -> DiffusersFolder:
    """The folder table of one generation; ``layouts``: its ``file_layouts``."""
    components = {"transformer": "CosmosTransformer3DModel", "vae": vae, "text_encoder": "T5EncoderModel"}
    sizes = (SizeMatch("text_encoder", "d_model", "text_embed_dim", 1024),)
    components["tokenizer"] = TOKENIZER
    return DiffusersFolder(name, pipelines, components, sizes=sizes, file_layouts=layouts or {})


BLOCKS = ("BlockLayer",)


def _spec(name: str, schema: type, frames: int, fps: int, settings: tuple[str, ...], what: str) -> ModelSpec:
    what = f"NVIDIA {what} (diffusers folder or original single-file transformer)"
    settings = ("t5_max_length", *settings)
    return diffusers_spec(name, schema, what, video=(frames, 1, fps), encoder_settings=settings, block_layers=BLOCKS)


class Cosmos(DiffusersModel, FlowSampling, VideoToWorld):
    """What both generations share: a video model (images are 1-frame clips), sizes in multiples of 16 (VAE 8 x
    patch 2), the VAE's posterior mode normalised as the pipelines' decode step inverts it, T5 embeddings zero past
    each caption, NVIDIA's original layout, the layer split and the EDM sampler."""

    variant: ClassVar[Variant]
    default_fps: ClassVar[float]
    trained: ClassVar[tuple[tuple[int, ...], set[tuple[int, int]]]]  # frames and (height, width) of the releases
    model_class = "CosmosTransformer3DModel"
    lora_target_names = LORA_TARGETS
    file_config = {  # 2B or 14B, from the file itself (NVIDIA's Predict2 or diffusers' names)
        "num_layers": blocks("blocks", "transformer_blocks"),
        "num_attention_heads": Shape(weight_of("x_embedder.proj.1", "patch_embed.proj"), 0, per="attention_head_dim"),
        "text_embed_dim": Shape(weight_of("blocks.0.cross_attn.k_proj", "transformer_blocks.0.attn2.to_k"), 1),
    }

    def original_layout(self, transformer_config: dict[str, Any]) -> KeyTable:
        from diffpipe_cosmos.nvidia import layout

        return layout(self.variant, int(transformer_config.get("num_layers", 28)))

    def lora_layout(self, state_dict: dict[str, torch.Tensor]) -> KeyTable:
        from diffpipe_core.parts.layout import count_blocks
        from diffpipe_cosmos.nvidia import layout

        return layout(self.variant, count_blocks(state_dict, r"transformer_blocks\.(\d+)\."))

    def sigma_data(self, model_config: CosmosConfigBase) -> float:
        """The EDM sigma_data the latents are scaled by (Predict2's pipelines use 1)."""
        return float(getattr(model_config, "sigma_data", 1.0))

    @hookimpl
    def validate_model_files(self, model_config: CosmosConfigBase) -> list[str]:
        """The folder's structure (pipeline, transformer, VAE, T5 and tokenizer classes, transformer weights) and
        the single file's keys, of this generation, without reading weights; for video-to-world, the transformer's
        condition-mask channel."""
        return super().validate_model_files(model_config) or self.conditioning_problems(model_config)

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, T, H/8, W/8) as ``(mode - mean) * sigma_data / std`` with the VAE's statistics
        (1.0: per channel and latent frame, ``mode * sigma_data`` without; Predict2: per channel, sigma_data 1),
        ``mask`` (B, 1, 1, h, w) on the latent grid. Captions: ``t5_embeds`` (B, t5_max_length, d), zero past each
        caption, as the pipelines' ``_get_t5_prompt_embeds`` (the transformer attends to every position)."""
        from diffpipe_core.parts.latents import latent_mask, normalize, vae_mode
        from diffpipe_core.parts.text import TextEncoding, encode_text

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            self.warn_untrained(encoders, batch.pixels.shape)
            z = vae_mode(encoders.vae, batch.pixels, video=True)
            out["latents"] = normalize(z, *latent_stats(encoders.vae), self.sigma_data(encoders.config)).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape, video=True)
        if batch.captions is not None:
            text = TextEncoding(encoders.config.t5_max_length, use_mask=True, zero_padding=True)
            out["t5_embeds"] = encode_text(encoders.text_encoder, encoders.tokenizer, batch.captions, text).embeds
        return out

    def warn_untrained(self, encoders: Any, shape: tuple[int, ...]) -> None:
        """Log once per shape when frames and size are not what the released checkpoints were trained on."""
        frames, height, width = (shape[2] if len(shape) == 5 else 1), shape[-2], shape[-1]
        warned = encoders.__dict__.setdefault("warned", set())
        if (frames, height, width) in warned:
            return
        warned.add((frames, height, width))
        trained_frames, trained_sizes = self.trained
        if frames not in trained_frames or (height, width) not in trained_sizes:
            log.warning(
                "Cosmos %s: training on %d frames at %dx%d; the released checkpoints were trained on %s frames at %s "
                "(other sizes work, the model may need more steps to adapt)",
                *(self.variant, frames, width, height, " or ".join(map(str, trained_frames))),
                ", ".join(f"{w}x{h}" for h, w in sorted(trained_sizes)),
            )

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: CosmosConfigBase) -> list[nn.Module]:
        """Embedding (masks, RoPE, patch, timestep), each transformer block, final norm/projection."""
        from diffpipe_cosmos import layers

        return layers.split_into_layers(model, model_config.fps or self.default_fps)

    # ------------------------------------------------------------------------------------------ sampling
    # Each generation states its noise levels (``scheduler``: sigma_min, sigma_max, rho, final_sigmas_type), its
    # VAE's ``(temporal, spatial)`` compression (``vae_factors``), what the transformer sees at noise level sigma
    # (``input_scaling``: ``c_in`` and the timestep) and the denoised latents from its output (``denoised``).
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: CosmosConfigBase, generator: torch.Generator):
        """Noise ``(1, C, T, H/8, W/8)`` times sigma_max and the pipelines' Karras noise levels; video-to-world:
        first the conditioning of ``[model] sample_video`` (the VAE's posterior drawn from ``generator`` as the
        pipeline draws it)."""
        import torch

        from diffpipe_core.sampling.schedules import karras_sigmas

        s, (temporal, spatial) = self.scheduler(model_config), self.vae_factors(model_config)
        channels = int(self.model_folder_config(model_config).get("out_channels", 16))
        shape = (1, channels, (request.frames - 1) // temporal + 1, request.height // spatial, request.width // spatial)
        zero = s["final_sigmas_type"] == "zero"
        sigmas = karras_sigmas(request.steps, s["sigma_min"], s["sigma_max"], s["rho"], zero)
        self.start_conditioned(sigmas, model_config, request, generator)
        return torch.randn(shape, generator=generator) * s["sigma_max"], sigmas

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(c_in * x, timestep, t5_embeds)``, the layout :meth:`prepare_inputs` gives the first layer; video-to-
        world: the conditioning frames and mask as the pipeline gives them (:meth:`conditioned_denoise_inputs`)."""
        conditioned = self.conditioned_denoise_inputs(latents, schedule, index, model_config)
        if conditioned is not None:
            return (*conditioned, text["t5_embeds"].float())
        c_in, timestep = self.input_scaling(schedule[index], model_config)
        return latents.float() * c_in, timestep.expand(latents.shape[0]), text["t5_embeds"].float()

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """The EDM Euler step to ``schedule[index + 1]`` from the denoised latents (video-to-world: the conditioning
        frames' replaced by the conditioning latents, as the pipelines do)."""
        from diffpipe_core.sampling.schedules import edm_euler_step

        denoised = self.denoised(latents.float(), prediction.float(), schedule[index], model_config)
        denoised = self.replace_conditioned(denoised, schedule, index, model_config)
        return edm_euler_step(latents, denoised, schedule, index)

    @hookimpl
    def load_decoder(self, model_config: CosmosConfigBase, device: torch.device) -> Any:
        """The VAE alone (``encoder_dtype``), frozen, knowing the sigma_data the latents are scaled by."""
        vae = super().load_decoder(model_config, device)
        vae.diffpipe_sigma_data = self.sigma_data(model_config)
        return vae

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """``latents * std / sigma_data + mean``: the pipelines' decode step."""
        from diffpipe_core.parts.latents import denormalize

        return denormalize(latents.float(), *latent_stats(vae), vae.diffpipe_sigma_data)


def latent_stats(vae: Any) -> tuple[Any, Any]:
    """The VAE's ``latents_mean`` and ``latents_std`` (0 and 1 when it has none)."""
    c = vae.config
    return (c.latents_mean, c.latents_std) if c.latents_mean is not None and c.latents_std is not None else (0.0, 1.0)


class Cosmos1(Cosmos):
    """Cosmos-1.0 Diffusion text-to-world: EDM training and sampling (``EDMEulerScheduler``)."""
    #: the released size (Cosmos-1.0-Diffusion-7B-Text2World) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: diffusers' CosmosTransformer3DModel defaults, which are that model's transformer/config.json; its CV8x8x8
    #: tokenizer (16 channels, 8x8x8); T5-11B's 1024-wide features at t5_max_length's default 512
    plan_size = {
        "transformer": {"in_channels": 16, "out_channels": 16, "num_attention_heads": 32, "attention_head_dim": 128,
                        "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
                        "max_size": [128, 240, 240], "patch_size": [1, 2, 2], "rope_scale": [2.0, 1.0, 1.0],
                        "concat_padding_mask": True, "extra_pos_embed_type": "learnable"},
        "vae": {"latent_channels": 16, "spatial_compression_ratio": 8, "temporal_compression_ratio": 8},
        "text": {"t5_embeds": (512, 1024)},
    }  # fmt: skip
    tiny_writer = "diffpipe_cosmos.testing:write_tiny_cosmos1"  # python -m diffpipe_core.testing.tiny_models

    variant, default_fps = "1.0", 30.0
    trained = ((121,), SIZES_720P)
    spec = _spec("cosmos", Cosmos1Config, 8, 30, ("sigma_data",), "Cosmos-1.0 Diffusion text-to-world")
    folder = _folder("cosmos", ("CosmosTextToWorldPipeline", "CosmosVideoToWorldPipeline"), "AutoencoderKLCosmos")
    single_file_markers = ("blocks.block0.blocks.0.block.attn.to_q.0.weight",)
    sibling_markers = {"cosmos-predict2": ("Cosmos-Predict2 transformer", ("blocks.0.self_attn.q_proj.weight",))}
    single_file_name = "cosmos1-transformer.safetensors"
    file_config = {  # 7B or 14B (NVIDIA's 1.0 names: blocks.blockN.blocks.K.block...)
        **Cosmos.file_config,
        "num_layers": r"(?:^|\.)(?:blocks\.block|transformer_blocks\.)(\d+)\.",
        "text_embed_dim": Shape(
            weight_of("blocks.block0.blocks.1.block.attn.to_k.0", "transformer_blocks.0.attn2.to_k"), 1
        ),
    }

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((c_in * x, c_noise, t5_embeds), (x_0, x, sigma, sigma_data[, mask]))``: ``log sigma ~ N(p_mean,
        p_std)``, ``x = x_0 + sigma * noise`` (:func:`diffpipe_core.edm.edm_sample`); video-to-world: the
        conditioning frames and mask, and a loss mask (:func:`diffpipe_cosmos.video2world.edm_inputs`)."""
        import torch

        from diffpipe_core import edm
        from diffpipe_core.parts.flow import with_mask

        cfg: Cosmos1Config = context.model_config  # type: ignore[assignment]
        latents = batch["latents"].float()
        s = edm.edm_sample(latents, generator, cfg.p_mean, cfg.p_std, cfg.sigma_data, context.eval_quantile)
        if self.conditioned(cfg):
            from diffpipe_cosmos.video2world import edm_inputs

            return edm_inputs(latents, s, batch, cfg, generator)
        targets = with_mask((latents, s.x, s.sigma, torch.full((latents.shape[0],), cfg.sigma_data)), batch)
        return (s.pre.c_in.view(-1, 1, 1, 1, 1) * s.x, s.pre.c_noise, batch["t5_embeds"].float()), targets

    @hookimpl
    def compute_loss(self, outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """EDM-weighted error of the denoised latent ``(sigma^2 + sigma_data^2) / (sigma * sigma_data)^2 *
        |D - x_0|^2`` (mask-weighted when the dataset gives masks)."""
        from diffpipe_core.edm import edm_loss

        latents, x, sigma, sigma_data = targets[:4]
        return edm_loss(outputs[0], x, latents, sigma, float(sigma_data[0]), targets[4] if len(targets) > 4 else None)

    def scheduler(self, model_config: CosmosConfigBase) -> dict[str, Any]:
        """``scheduler/scheduler_config.json`` over EDMEulerScheduler's defaults (Karras levels only)."""
        file = model_config.path / "scheduler" / "scheduler_config.json"
        found = {**EDM_DEFAULTS, **(json.loads(file.read_text()) if file.is_file() else {})}
        if found.get("sigma_schedule", "karras") != "karras":
            raise ValueError(f"{file}: sigma_schedule {found['sigma_schedule']!r}; sampling supports 'karras'")
        return found

    def vae_factors(self, model_config: CosmosConfigBase) -> tuple[int, int]:
        vae = self.folder.config(model_config.path, "vae")
        return int(vae.get("temporal_compression_ratio", 8)), int(vae.get("spatial_compression_ratio", 8))

    def input_scaling(self, sigma, model_config):
        from diffpipe_core.edm import preconditioning

        pre = preconditioning(sigma, self.sigma_data(model_config))
        return pre.c_in, pre.c_noise

    def denoised(self, x, out, sigma, model_config):
        from diffpipe_core.edm import denoise

        return denoise(out, x, sigma, self.sigma_data(model_config))


class Predict2(Cosmos):
    """Cosmos-Predict2 text-to-image and video: rectified-flow training; NVIDIA's pipelines sample it in EDM terms
    (sigma_data 1): the transformer sees ``x_sigma / (1 + sigma)`` at ``t = sigma / (1 + sigma)``, the denoised
    latent is ``(1 - t) x_sigma - t F``. With ``x_t = (1 - t) x_0 + t noise`` that is ``x_t - t F``: a velocity
    model (``F = noise - x_0``), and NVIDIA's EDM weight times ``|D - x_0|^2`` is ``(t^2 + (1 - t)^2) |F - (noise -
    x_0)|^2`` (``nvidia_weighting``)."""
    #: the released size (Cosmos-Predict2-2B-Text2Image) for the GPU-fit table: its transformer/config.json
    #: (16 heads of 128, 28 blocks, RoPE scale 1/4/4, no extra position embedding); the Wan 2.1 VAE; T5-11B (1024)
    plan_size = {
        "transformer": {"in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
                        "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
                        "max_size": [128, 240, 240], "patch_size": [1, 2, 2], "rope_scale": [1.0, 4.0, 4.0],
                        "concat_padding_mask": True, "extra_pos_embed_type": None},
        "vae": {"z_dim": 16, "scale_factor_spatial": 8, "scale_factor_temporal": 4},
        "text": {"t5_embeds": (512, 1024)},
    }  # fmt: skip
    tiny_writer = "diffpipe_cosmos.testing:write_tiny_predict2"  # python -m diffpipe_core.testing.tiny_models

    variant, default_fps = "predict2", 16.0
    trained = ((1, 93), SIZES_720P | {(1024, 1024), (768, 1360), (1360, 768)})
    spec = _spec("cosmos-predict2", Predict2Config, 4, 16, (), "Cosmos-Predict2 text-to-image / video")
    # ComfyUI's wan_2.1_vae.safetensors: the Wan VAE's original layout
    folder = _folder(
        "cosmos-predict2",
        ("Cosmos2TextToImagePipeline", "Cosmos2VideoToWorldPipeline"),
        "AutoencoderKLWan",
        {"vae": wan_vae_table},
    )
    single_file_markers = ("blocks.0.self_attn.q_proj.weight",)
    sibling_markers = {"cosmos": ("Cosmos-1.0 transformer", Cosmos1.single_file_markers)}
    single_file_name = "cosmos-predict2-transformer.safetensors"

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, t5_embeds), (noise - x_0, weight[, mask]))`` (:func:`diffpipe_core.parts.flow.flow_sample`);
        ``weight`` is ``t^2 + (1 - t)^2`` with ``nvidia_weighting``, else ones. Video-to-world: ``x_t`` with the
        clean conditioning frames and the mask channel, per-frame ``t`` and a loss mask
        (:func:`diffpipe_cosmos.video2world.flow_inputs`)."""
        import torch

        from diffpipe_core.parts.flow import flow_sample, with_mask

        cfg: Predict2Config = context.model_config  # type: ignore[assignment]
        f = flow_sample(batch["latents"], cfg, context, generator)
        weight = nvidia_weight(f.t) if cfg.nvidia_weighting else torch.ones(f.t.shape[0])
        if self.conditioned(cfg):
            from diffpipe_cosmos.video2world import flow_inputs

            x, timestep, mask = flow_inputs(batch["latents"].float(), f, batch, cfg)
            return (x, timestep, batch["t5_embeds"].float()), (f.target, weight, mask)
        return (f.x_t, f.t, batch["t5_embeds"].float()), with_mask((f.target, weight), batch)

    @hookimpl
    def compute_loss(self, outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Per-sample weighted MSE to ``noise - x_0`` (mask-weighted when the dataset gives masks)."""
        from diffpipe_core.edm import weighted_mse

        return weighted_mse(outputs[0], targets[0], targets[1], targets[2] if len(targets) > 2 else None)

    def scheduler(self, model_config: CosmosConfigBase) -> dict[str, Any]:
        """The values both Predict2 pipelines set over their scheduler's config."""
        return dict(EDM_DEFAULTS, final_sigmas_type="sigma_min")

    def vae_factors(self, model_config: CosmosConfigBase) -> tuple[int, int]:
        down = list(self.folder.config(model_config.path, "vae").get("temperal_downsample", [False, True, True]))
        return 2 ** sum(map(bool, down)), 2 ** len(down)

    def input_scaling(self, sigma, model_config):
        t = sigma / (sigma + 1)
        return 1 - t, t

    def denoised(self, x, out, sigma, model_config):
        t = sigma / (sigma + 1)
        return (1 - t) * x + -t * out


def nvidia_weight(t: torch.Tensor) -> torch.Tensor:
    """``t^2 + (1 - t)^2``: Predict2's EDM loss weight (sigma_data 1) in rectified-flow time (:class:`Predict2`)."""
    return t**2 + (1 - t) ** 2


cosmos1 = Cosmos1()
predict2 = Predict2()
