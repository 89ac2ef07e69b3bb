"""FLUX.3 (entry point ``flux3``: ``flux-3-image-klein-base``) and the step-distilled FLUX.3 (``flux3-distilled``:
``flux-3-image-klein``, a flow map), as diffusers' FLUX.3 modular pipelines run them.

FLUX.3 keeps FLUX.2's VAE and latents (the posterior's mode in 2x2 patches, batch-norm normalised: FLUX.2's
:meth:`~diffpipe_flux.flux2.Flux2.encode_media`) and conditions on the caption's Qwen3-VL hidden states at eight
layers, stacked. The transformer runs per-mode blocks first (the text, the image, each attending within itself),
then joint blocks over ``[text, image]``, each mode with its own modulation (the text at time 0). The caption text is
the modular pipeline's text block's own (``Flux3TextEncoderStep``: the chat template, the window padded to a multiple
of 80 tokens, which the transformer attends to). The distilled checkpoint is a flow map: each step also embeds the
time it jumps to. Text-to-image training; the reference-image mode (``image_cond``) is not trained. This module
imports no torch: hooks import it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from diffpipe_core import hookimpl
from diffpipe_core.parts.flux2_vae import vae_layout
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import diffusers_spec
from diffpipe_flux.config import Flux3Config, Flux3DistilledConfig
from diffpipe_flux.flux2 import VAE_OPTIONAL, Flux2

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "Flux3Transformer2DModel",
    "vae": "AutoencoderKLFlux2",
    "text_encoder": "Qwen3VLForConditionalGeneration",
    "tokenizer": TOKENIZER,
}
#: a block's linears (per-mode and joint blocks alike)
BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.linear_in", "ff.linear_out")
#: the modular pipeline's scheduler shift where the folder has no scheduler config (``Flux3SetTimestepsStep``)
SHIFT = 6.93


class Flux3(Flux2):
    """FLUX.3: per-mode then joint blocks over Qwen3-VL text features; sizes in multiples of 16 pixels; samples as
    ``Flux3ModularPipeline`` (classifier-free guidance, the pipeline's default 3.5 at ``[sample] cfg``)."""

    tiny_writer = "diffpipe_flux.testing_flux3:write_tiny_flux3"  # python -m diffpipe_core.testing.tiny_models
    spec = diffusers_spec(
        "flux3", Flux3Config,
        "FLUX.3 text-to-image (diffusers folder of the modular pipeline, or a BFL / diffusers single-file transformer)",
        contract=4, encoder_settings=("text_max_length",),
        block_layers=("Flux3TextModeLayer", "Flux3ImageModeLayer", "Flux3SingleLayer"), spatial_multiple=16,
        guidance_in_one_batch=False,  # the pipeline runs each prompt on its own window
    )
    folder = DiffusersFolder(
        "flux3",
        ("Flux3ModularPipeline", "Flux3DistilledModularPipeline"),
        COMPONENTS,
        single_file_example="flux-3-image-klein-base.safetensors",
        title="FLUX.3",
        file_layouts={"vae": vae_layout},  # FLUX.2's VAE file (BFL's ae.safetensors layout)
        file_optional={"vae": VAE_OPTIONAL, "text_encoder": ("lm_head.", "model.visual.")},
    )
    model_class = "Flux3Transformer2DModel"
    single_file_markers = ("early_stream_modulations.image.lin.weight", "single_blocks.0.q_proj.weight")
    file_config: ClassVar[dict[str, Any]] = {
        "num_layers": r"(?:^|\.)txt_mode_blocks\.(\d+)\.",
        "num_single_layers": r"(?:^|\.)(?:single_blocks|single_transformer_blocks)\.(\d+)\.",
        "flow_map": r"(?:^|\.)(?:ref_time_in|target_timestep_embedder)\.",
    }
    single_file_name = "flux3-transformer.safetensors"
    key_tables = "diffpipe_flux.flux3_keys"
    comfy_takes_diffusers_names = False  # no ComfyUI FLUX.3 yet: its layout is BFL's names, as diffusers reads them
    #: the released size (FLUX 3 Image Klein Base, 5.6 B as BFL's flux-3-image-klein README gives it) for the GPU-fit
    #: table (diffpipe_core.engine.fit_table): diffusers 0.42.1's Flux3Transformer2DModel defaults, which are the
    #: klein checkpoints' transformer/config.json (5 per-mode and 28 joint blocks of 24 x 128, joint_attention_dim
    #: 20480 = the modular pipeline's 8 tapped Qwen3-VL-4B layers x 2560); FLUX.2's VAE (32 channels, 16x with the
    #: 2x2 patches); the text window at text_max_length's default 512 (8 x 2560 per token)
    plan_size = {
        "transformer": {"in_channels": 128, "cond_in_channels": 128, "num_layers": 5, "num_single_layers": 28,
                        "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 20480,
                        "timestep_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32],
                        "rope_theta": 10000, "flow_map": False},
        "vae": {"latent_channels": 32, "block_out_channels": [128, 256, 512, 512]},
        "text": {"text_embeds": (512, 20480), "text_valid": (512,)},
    }  # fmt: skip
    pipeline_class: ClassVar[str] = "Flux3ModularPipeline"  # (FLUX.2's text pipeline is not used: the text block is)

    def default_lora_targets(self, model_config: Any) -> list[str]:
        """Every block's linears that text-to-image training runs: the text and image mode blocks and the joint
        blocks (by full name: the reference-image mode blocks have the same names and never run)."""
        config = self.model_folder_config(model_config)
        n, single = int(config.get("num_layers", 5)), int(config.get("num_single_layers", 28))
        blocks = [f"txt_mode_blocks.{i}" for i in range(n)] + [f"mode_blocks.image.{i}" for i in range(n)]
        blocks += [f"single_transformer_blocks.{i}" for i in range(single)]
        return [f"{b}.{name}" for b in blocks for name in BLOCK_LINEARS]

    @hookimpl
    def export_adapter(self, state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str) -> Any:
        """``diffusers``: peft keys under ``transformer.``; ``comfyui``: BFL's module names under ``diffusion_model.``
        with the strength folded into ``lora_B`` and no ``.alpha`` tensors, the non-diffusers format diffusers'
        ``Flux3LoraLoaderMixin`` reads (ComfyUI has no FLUX.3 model yet; its loaders take a missing alpha as the
        rank, so the file applies at the trained strength there too)."""
        out = super().export_adapter(state_dict, alpha, rank, format)
        if format != "comfyui" or out is None:
            return out
        scale = float(alpha) / rank
        return {k: v * scale if scale != 1 and k.endswith(".lora_B.weight") else v
                for k, v in out.items() if not k.endswith(".alpha")}

    @hookimpl
    def validate_model_files(self, model_config: Any) -> list[str]:
        """The files (the shared checks), then that the text encoder fits the transformer: it has the layers the
        pipeline's text block taps, whose stacked width is the transformer's ``joint_attention_dim``."""
        problems = super().validate_model_files(model_config)
        if problems:
            return problems
        from diffpipe_flux.flux3_text import text_fit_problem

        folder = self.model_folder(model_config)
        return text_fit_problem(self.folder.config(folder, "text_encoder"), self.model_folder_config(model_config),
                                folder / "text_encoder" / "config.json")

    def flow_map(self, model_config: Any) -> bool:
        """Whether the transformer is a flow map (the step-distilled checkpoint: ``flow_map`` in its config)."""
        return bool(self.model_folder_config(model_config).get("flow_map", False))

    def scheduler_config(self, model_config: Any) -> dict[str, Any]:
        """The pipeline's scheduler config: the folder's ``scheduler/scheduler_config.json`` over the modular
        pipeline's default (a constant shift of 6.93)."""
        from diffpipe_core.model_files import read_json

        config, _ = read_json(self.model_folder(model_config) / "scheduler" / "scheduler_config.json")
        return {"shift": SHIFT, **(config or {})}

    def training_shift(self, model_config: Any) -> float:
        """The shift of the training times: with ``scheduler_shift`` the scheduler's constant shift, else ``shift``."""
        if not model_config.scheduler_shift:
            return model_config.shift
        return float(self.scheduler_config(model_config)["shift"])

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: Flux3Config, device: torch.device) -> Any:
        """The VAE, Qwen3-VL and its processor (the folder's ``tokenizer``), and the modular pipeline's text block
        (its pad multiple and tapped layers)."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.vl_processors import ImageOnlyQwen3VLProcessor, load_processor
        from diffpipe_flux.flux3_text import text_step

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder")
        enc.processor = load_processor(self.model_folder(model_config) / "tokenizer", ImageOnlyQwen3VLProcessor)
        enc.text_step = text_step()
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 4C, H/16, W/16) as the pipeline's ``Flux3VaeEncoderStep`` makes them (FLUX.2's
        patchified, batch-norm normalised latents), ``mask`` on that grid. Captions: ``text_embeds`` (B,
        text_max_length, 8 x d) and ``text_valid`` (B, text_max_length): each caption's text window as the
        pipeline's text block computes it (its padding to a multiple of 80 included), zeros after it."""
        return super().encode_batch(encoders, batch)

    def encode_captions(self, encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """Each caption through the text block (:func:`diffpipe_flux.flux3_text.encode_captions`) at
        ``max_sequence_length = text_max_length``."""
        from diffpipe_flux.flux3_text import encode_captions

        return encode_captions(encoders.text_step, encoders.text_encoder, encoders.processor, list(captions),
                               encoders.config.text_max_length, encoders.device)

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: Flux3Config) -> list[nn.Module]:
        """Embedders (+ the rotary tables and the modulations, computed once), each text mode block, each image mode
        block, each joint block, the output layer."""
        from diffpipe_flux import flux3_layers

        return flux3_layers.split_into_layers(model)

    def first_inputs(self, x: torch.Tensor, t: torch.Tensor, text: dict[str, torch.Tensor], flow_map: bool,
                     target_t: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """``(tokens, t, text, text_valid, grid[, target_t])`` for latents ``x`` ``(B, C, h, w)``: the text cut to
        the longest window among the rows; a flow map's target time ``target_t`` (default ``t``: the diagonal)."""
        import torch

        from diffpipe_core.parts.text import trimmed
        from diffpipe_flux.flux2_latents import tokens

        h, w = x.shape[-2:]
        embeds, valid = trimmed(text["text_embeds"], text["text_valid"])
        inputs = (tokens(x.float()), t, embeds, valid, torch.tensor([h, w]))
        return (*inputs, t if target_t is None else target_t) if flow_map else inputs

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text, text_valid, grid[, target_t]), (velocity[, mask]))``, one token per latent patch;
        rectified flow shifted as the pipeline's scheduler shifts (``scheduler_shift``) or by ``shift``. A flow map
        trains at its diagonal (target time = time), where it is the velocity the loss compares."""
        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_flux.flux2_latents import tokens

        cfg: Flux3Config = context.model_config  # type: ignore[assignment]
        f = flow_sample(batch["latents"], cfg, context, generator, self.training_shift(cfg))
        shape = f.x_t.shape
        targets = with_mask((tokens(f.target),), batch, lambda m: tokens(m.expand(*shape).contiguous()))
        return self.first_inputs(f.x_t, f.t, batch, self.flow_map(cfg)), targets

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: Flux3Config, generator: torch.Generator):
        """Noise ``(1, 4C, H/16, W/16)`` drawn as ``Flux3PrepareLatentsStep`` draws it, and the sigmas its scheduler
        makes of ``linspace(1, 1/steps, steps)`` (``Flux3SetTimestepsStep``), a final 0 appended."""
        import numpy as np
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        factor = 2 ** (len(self.folder.config(self.model_folder(model_config), "vae")["block_out_channels"]) - 1) * 2
        c = int(self.model_folder_config(model_config).get("in_channels", 128))
        noise = torch.randn((1, c, request.height // factor, request.width // factor), generator=generator)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config(model_config))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / request.steps, request.steps), device="cpu")
        return noise, scheduler.sigmas.float()

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's inputs at ``schedule[index]`` (the scheduler's timestep / 1000, as the pipeline hands it
        on); a flow map's target time is the next step's (0 after the last)."""
        b = latents.shape[0]
        # the pipeline hands the transformer its scheduler's timestep (sigma * 1000, float32) divided by 1000
        t = (schedule[index].float() * 1000 / 1000).expand(b)
        target = (schedule[index + 1].float() * 1000 / 1000).expand(b)
        return self.first_inputs(latents, t, text, self.flow_map(model_config), target)


class Flux3Distilled(Flux3):
    """The step-distilled FLUX.3 (a flow map): samples as ``Flux3DistilledModularPipeline`` (16 steps, no guidance).
    Trained at the flow map's diagonal; ``[model] cfg`` for CFG-augmented training (see the README)."""

    tiny_writer = "diffpipe_flux.testing_flux3:write_tiny_flux3_distilled"
    spec = replace(
        Flux3.spec, name="flux3-distilled", config_schema=Flux3DistilledConfig,
        description="FLUX.3 step-distilled (a flow map: few steps, no guidance; diffusers folder or single file)",
    )
    folder = replace(Flux3.folder, model_name="flux3-distilled", single_file_example="flux-3-image-klein.safetensors")
    #: the released size (FLUX 3 Image Klein, the step-distilled checkpoint): the base model's transformer with the
    #: flow map's target-time embedder (``flow_map``, as its transformer/config.json sets it); the same VAE and text
    plan_size = {
        **Flux3.plan_size,
        "transformer": {**Flux3.plan_size["transformer"], "flow_map": True},
    }  # fmt: skip


flux3 = Flux3()
flux3_distilled = Flux3Distilled()
