"""FLUX.2 [dev] (entry point ``flux2``) and FLUX.2 [klein] (entry point ``flux2-klein``), as ``Flux2Pipeline`` and
``Flux2KleinPipeline`` run them.

FLUX.2 keeps Flux.1's double/single-block design and 2x2 patches, with a new VAE (``AutoencoderKLFlux2``: latents
patchified and normalised by its batch-norm statistics, :mod:`diffpipe_flux.flux2_latents`), one text encoder whose
hidden layers are stacked (dev: Mistral3; Klein: Qwen3, chat-templated), no pooled text vector, modulations shared by
all blocks, and four-axis position ids. The caption tensors are the pipeline's own ``encode_prompt`` (called on a
pipeline holding only its text encoder and tokenizer). Klein has no guidance embedding. Everything Flux's plugin does
alike is Flux's (:class:`~diffpipe_flux.plugin.Flux`). This module imports no torch.

Reference images (edit training) need no other entry point: the same weights and pipeline class do both, as the
pipelines' ``image=`` argument does. Items of a ``[[directory]]`` with ``control_path`` train with their control
images as reference images: each decoded at its own aspect ratio, encoded like a target (``_encode_vae_image``), its
tokens appended after the noisy target's with the time offset ``10 + 10 k`` of ``_prepare_image_ids``; the loss
covers the target's tokens, as the pipelines drop the references' from the prediction. Items without train as
text-to-image, in micro-batches of their own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import present
from diffpipe_core.parts.flux2_vae import vae_layout
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_flux.config import Flux2Config, Flux2KleinConfig
from diffpipe_flux.plugin import ATTENTION_AND_MLP, FLUX_FILE_CONFIG, Flux

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import TrainingContext

#: reference images per item: FLUX.2 [dev] takes up to 10 (BFL's model card); the pipelines set no limit
MAX_REFERENCES = 10
#: Flux.1's attention linears (the double blocks' q/k/v and outputs), FLUX.2's MLP names, the single blocks' fused input
TARGETS = [
    *ATTENTION_AND_MLP[:8],
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
]
DEFAULT_GUIDANCE = 4.0  # Flux2Pipeline's guidance_scale default
#: what ComfyUI's files leave out: the VAE batch norm's step count (never read in eval), the text encoders' LM head
#: (the pipelines read hidden states) and Mistral 3's vision tower (ComfyUI's Mistral file is the language model)
VAE_OPTIONAL = ("bn.num_batches_tracked",)
MISTRAL_VISION = ("model.vision_tower.", "model.multi_modal_projector.")


def components(text_encoder: str) -> dict[str, str]:
    return {
        "transformer": "Flux2Transformer2DModel",
        "vae": "AutoencoderKLFlux2",
        "text_encoder": text_encoder,
        "tokenizer": TOKENIZER,
    }


class Flux2(Flux):
    """FLUX.2 [dev]: a guidance-distilled image model on Mistral3 text features; sizes in multiples of 16 pixels."""
    #: the released size (FLUX.2 [dev], 32 B) for the model page's GPU-fit table (diffpipe_core.engine.fit_table):
    #: black-forest-labs/FLUX.2-dev's transformer/config.json (diffusers' Flux2Transformer2DModel defaults, and
    #: scripts/convert_flux2_to_diffusers.py's "flux2-dev"); the VAE's 32 latent channels; Mistral Small 3.1's
    #: three stacked hidden layers (3 x 5120) at text_max_length's default 512
    plan_size = {
        "transformer": {"in_channels": 128, "num_layers": 8, "num_single_layers": 48, "attention_head_dim": 128,
                        "num_attention_heads": 48, "joint_attention_dim": 15360, "mlp_ratio": 3.0,
                        "timestep_guidance_channels": 256, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000,
                        "guidance_embeds": True},
        "vae": {"latent_channels": 32, "block_out_channels": [128, 256, 512, 512]},
        "text": {"text_embeds": (512, 15360)},
    }  # fmt: skip
    tiny_writer = "diffpipe_flux.testing:write_tiny_flux2"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        Flux.spec,
        name="flux2",
        config_schema=Flux2Config,
        encoder_settings=("path", "encoder_dtype", "text_max_length"),
        block_layers=("Flux2DoubleBlockLayer", "Flux2SingleBlockLayer"),
        control_images="optional",
        max_control_images=MAX_REFERENCES,
        control_size="own",
        description="FLUX.2 [dev] (diffusers Flux2Pipeline folder or the BFL/ComfyUI single-file transformer)",
    )
    folder = DiffusersFolder(
        "flux2",
        ("Flux2Pipeline",),
        components("Mistral3ForConditionalGeneration"),
        single_file_example="flux2_dev.safetensors",
        file_layouts={"vae": vae_layout},
        file_optional={"vae": VAE_OPTIONAL, "text_encoder": ("lm_head.", *MISTRAL_VISION)},
    )
    model_class = "Flux2Transformer2DModel"
    comfy_takes_diffusers_names = False  # ComfyUI's diffusers-name map is Flux.1's; FLUX.2 LoRAs use native names
    single_file_markers = ("double_stream_modulation_img.lin.weight", "single_blocks.0.linear1.weight")
    file_config = {
        **FLUX_FILE_CONFIG,
        "guidance_embeds": present("guidance_in", "time_guidance_embed.guidance_embedder"),  # dev has it, klein not
    }
    single_file_name = "flux2-transformer.safetensors"
    key_tables = "diffpipe_flux.flux2_keys"
    pipeline_class: ClassVar[str] = "Flux2Pipeline"

    def default_lora_targets(self, model_config: Any) -> list[str]:
        """Attention and MLP linears of the double blocks, the fused ``to_qkv_mlp_proj`` of the single blocks and
        their output linear (``attn.to_out``, by full name: a double block's ``attn.to_out`` is a module list)."""
        n_single = int(self.model_folder_config(model_config).get("num_single_layers", 0))
        return TARGETS + [f"single_transformer_blocks.{i}.attn.to_out" for i in range(n_single)]

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: Flux2Config, device: torch.device) -> Any:
        """The VAE, and the text encoder with its tokenizer in a pipeline holding only them (``encoders.text``), so
        the chat template and the stacked hidden layers are the pipeline's own."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.text = text_pipeline(self.pipeline_class, text_encoder=enc.text_encoder, tokenizer=enc.tokenizer)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: Any) -> dict[str, torch.Tensor]:
        """Media (targets and reference images alike): ``latents`` (B, 4C, H/16, W/16), ``mask`` on that grid (targets
        only). Captions: ``text_embeds``
        (B, text_max_length, 3 x hidden), as the pipeline's ``_encode_vae_image`` and ``encode_prompt`` make them."""
        return super().encode_batch(encoders, batch)

    def encode_media(self, encoders: Any, batch: Any) -> dict[str, torch.Tensor]:
        """``latents`` ``(B, 4C, H/16, W/16)``: the mode patchified 2x2 and batch-norm normalised, as the pipeline's
        ``_encode_vae_image``; ``mask`` on that grid."""
        from diffpipe_core.parts.latents import latent_mask, vae_mode
        from diffpipe_flux.flux2_latents import normalized

        out = {"latents": normalized(encoders.vae, vae_mode(encoders.vae, batch.pixels))}
        if batch.masks is not None:
            out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        return out

    def encode_captions(self, encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """``text_embeds`` ``(B, text_max_length, layers x d)``: the pipeline's ``encode_prompt`` (no mask: the
        transformer attends to the padding, as in the pipeline)."""
        import torch

        with torch.no_grad():
            embeds, _ = encoders.text.encode_prompt(
                list(captions), device=encoders.device, max_sequence_length=encoders.config.text_max_length
            )
        return {"text_embeds": embeds.float().cpu()}

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: Flux2Config) -> list[nn.Module]:
        """Embedders with the shared modulations, each double block, each single block, final norm/projection."""
        from diffpipe_flux import flux2_layers

        return flux2_layers.split_into_layers(model)

    def guidance(self, model_config: Any) -> float:
        return float(getattr(model_config, "guidance", 1.0))

    def first_inputs(
        self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, guidance: float, source: dict[str, torch.Tensor]
    ):
        """``(tokens, t, text, guidance, img_ids, txt_ids)`` for latents ``x`` ``(B, C, h, w)``, followed by the
        reference images' tokens and ids (``control_<k>_latents`` of ``source``: the micro-batch, or the sample
        prompt's tensors)."""
        import torch

        from diffpipe_core.types import control_values
        from diffpipe_flux.flux2_latents import image_ids, text_ids, tokens, with_references

        b, _, h, w = x.shape
        text = text.float()
        img, ids = with_references(tokens(x.float()), image_ids(h, w), control_values(source, "latents"))
        return img, t, text, torch.full((b,), guidance), ids, text_ids(text.shape[1])

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, guidance, img_ids, txt_ids), (target[, mask]))``, one token per latent patch;
        rectified flow (:func:`diffpipe_core.parts.flow.flow_sample`) with ``shift``. An edit pair's reference images
        follow the target's tokens in ``x_t`` and ``img_ids``; the targets cover the target's tokens."""
        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_flux.flux2_latents import tokens

        cfg = context.model_config
        f = flow_sample(batch["latents"], cfg, context, generator, cfg.shift)  # type: ignore[attr-defined]
        shape = f.x_t.shape
        targets = with_mask((tokens(f.target),), batch, lambda m: tokens(m.expand(*shape).contiguous()))
        return self.first_inputs(f.x_t, f.t, batch["text_embeds"], self.guidance(cfg), batch), targets

    @hookimpl
    def compute_loss(
        self, outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...], context: TrainingContext
    ) -> torch.Tensor:
        """The run's loss on the target's tokens (the prediction's first ``len(target)``; reference images' tokens
        come after them), mask-weighted."""
        from diffpipe_core.parts.flow import flow_loss, leading_tokens

        return flow_loss(leading_tokens(outputs, targets), targets, context)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: Any, model_config: Flux2Config, generator: torch.Generator):
        """Noise on the patch grid and the pipeline's sigmas (shifted by its empirical ``mu``)."""
        from diffpipe_core.model_files import read_json
        from diffpipe_flux.flux2_latents import denoise_init

        path = self.model_folder(model_config)
        scheduler, _ = read_json(path / "scheduler" / "scheduler_config.json")
        transformer, vae = self.model_folder_config(model_config), self.folder.config(path, "vae")
        return denoise_init(transformer, vae, scheduler or {}, request, generator)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's inputs at ``schedule[index]`` (``[sample] guidance``, default 4.0, for dev), with the
        prompt's reference images (``[sample] control_images``) appended as in training."""
        guidance = DEFAULT_GUIDANCE if request.guidance is None else request.guidance
        t = schedule[index].float().expand(latents.shape[0])
        return self.first_inputs(latents, t, text["text_embeds"], float(guidance), text)

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The prediction for the target's tokens (the reference images' follow them), back on the patch grid."""
        from diffpipe_flux.flux2_latents import untokens

        h, w = latents.shape[-2], latents.shape[-1]
        return untokens(prediction[:, : h * w], h, w)

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """Undo the batch-norm normalisation and the 2x2 patches, as the pipeline does before decoding."""
        from diffpipe_flux.flux2_latents import raw

        return raw(vae, latents).to(next(vae.parameters()).device)


class Flux2Klein(Flux2):
    """FLUX.2 [klein]: FLUX.2 on Qwen3 text features (chat template, stacked hidden layers), no guidance input."""
    #: the released size (FLUX.2 [klein] 4B) for the GPU-fit table: diffusers'
    #: scripts/convert_flux2_to_diffusers.py's "klein-4b" config (black-forest-labs/FLUX.2-klein-4B); Qwen3-4B's
    #: three stacked hidden layers (3 x 2560) at text_max_length's default 512
    plan_size = {
        **Flux2.plan_size,
        "transformer": {**Flux2.plan_size["transformer"], "num_layers": 5, "num_single_layers": 20,
                        "num_attention_heads": 24, "joint_attention_dim": 7680, "guidance_embeds": False},
        "text": {"text_embeds": (512, 7680)},
    }  # fmt: skip
    tiny_writer = "diffpipe_flux.testing:write_tiny_klein"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        Flux2.spec,
        name="flux2-klein",
        config_schema=Flux2KleinConfig,
        description="FLUX.2 [klein] (diffusers Flux2KleinPipeline folder or the BFL/ComfyUI single-file transformer)",
    )
    folder = DiffusersFolder(
        "flux2-klein",
        ("Flux2KleinPipeline",),
        components("Qwen3ForCausalLM"),
        single_file_example="flux-2-klein-4b.safetensors",
        file_layouts={"vae": vae_layout},
        file_optional={"vae": VAE_OPTIONAL, "text_encoder": ("lm_head.",)},
    )
    pipeline_class: ClassVar[str] = "Flux2KleinPipeline"


flux2 = Flux2()
klein = Flux2Klein()
