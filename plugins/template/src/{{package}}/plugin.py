"""The {{name}} model plugin: what differs from diffpipe's shared diffusers parts.

Declared: the diffusers folder's components, the diffusion model's class, the LoRA targets. Written: running
the encoders, the pipeline layers, the first layer's inputs, the sampler's noise and inputs. The rest comes
from ``DiffusersModel`` (validating the folder, whole and per-stage loading, the loss, exports) and ``FlowSampling``
(the folder scheduler's step, decoding). This module imports no torch, diffusers or transformers (``diffpipe models``,
``validate`` and ``--help`` import every plugin): each hook imports what it needs when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling

from {{package}}.config import ModelConfig

if TYPE_CHECKING:
    import torch
    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest
    from torch import nn

PIPELINES = ("{{class_name}}Pipeline",)  # model_index.json's _class_name
SAMPLE_PIPELINE = None  # the diffusers pipeline your samples must equal (the kit compares)
VIDEO = {{video}}  # a video VAE: (B, 3, F, H, W) -> (B, C, 1 + (F - 1) / 4, H / 8, W / 8); images are one frame
COMPONENTS = {  # model_index.json's components -> class name ("module:Class" for a class of your own)
    "transformer": "{{package}}.model:TinyDiT",
    "vae": "{{vae_class}}",
    "text_encoder": "T5EncoderModel",
    "tokenizer": TOKENIZER,
}


class {{class_name}}(DiffusersModel, FlowSampling):
    """The {{modality}} model: VAE factor 8 x patch size 2 = sizes in multiples of 16 pixels."""

    spec = diffusers_spec(
        name="{{name}}",
        config_schema=ModelConfig,
        description="{{description}}",
        video={{video_frames}},  # a video: (frame_multiple, frame_offset, fps), (4, 1, 16.0) = 4k + 1 frames
        encoder_settings=("text_max_length",),  # [model] keys that change the cache (besides path, encoder_dtype)
        block_layers=("BlockLayer",),  # what activation checkpointing and block swapping act on
        adapter_formats=("diffusers",),
        model_formats=("diffusers",),
        contract={{contract}},  # the plugin contract this is written against (diffpipe_core.CONTRACT_VERSION)
    )
    folder = DiffusersFolder("{{name}}", PIPELINES, COMPONENTS)
    # Component files ([model] diffusion_model, vae, text_encoders) in diffusers' names load with no declaration. Files
    # in an original layout: DiffusersFolder(..., file_layouts={"vae": my_vae_table}) and key_tables = "my.module";
    # a file of another size than the folder's builds as itself with (diffpipe_core.parts.file_variant.blocks):
    # file_config = {"num_layers": blocks("transformer_blocks")}
    model_class = COMPONENTS["transformer"]
    lora_target_names = (  # the joint blocks' attention and MLP linears (exact names or dotted suffixes)
        *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"),  # image side
        *("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"),  # text side
        *("ff_context.net.0.proj", "ff_context.net.2"),
    )
    # nothing reads the last block's text output: there, its text queries and text-side outputs get no gradient
    last_block_unused = ("attn.add_q_proj", "attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2")
    sample_pipeline = SAMPLE_PIPELINE
    sample_pipeline_settings = {"max_sequence_length": "text_max_length"}  # its call arguments from [model] keys
    # python -m diffpipe_core.testing.tiny_models {{name}} DIR writes the tiny model with:
    tiny_writer = "{{package}}.testing:write_tiny_model"

    # ------------------------------------------------------------------------------------------ caching
    # load_encoders (DiffusersModel's): the VAE, text_encoder and tokenizer; encoders.config is the [model] table
    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (the VAE posterior's mode, ``(z - shift_factor) * scaling_factor``) and ``mask`` on the
        latent grid. Captions: ``text_embeds`` ``(B, text_max_length, d)``, zero after each caption's tokens."""
        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode
        from diffpipe_core.parts.text import TextEncoding, encode_text

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            z = vae_mode(encoders.vae, batch.pixels, video=VIDEO)
            out["latents"] = shift_and_scale(z, encoders.vae.config).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape, video=VIDEO)
        if batch.captions is not None:
            spec = TextEncoding(encoders.config.text_max_length, use_mask=True, zero_padding=True)
            out["text_embeds"] = encode_text(encoders.text_encoder, encoders.tokenizer, batch.captions, spec).embeds
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: ModelConfig) -> list[nn.Module]:
        """The embedders, each joint block, the output head (``layers.py``)."""
        from {{package}}.layers import split_into_layers

        return split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds), (velocity[, mask]))``: rectified flow with the ``[model]`` time options."""
        from diffpipe_core.parts.flow import flow_sample, with_mask

        f = flow_sample(batch["latents"], context.model_config, context, generator)
        return (f.x_t, f.t, batch["text_embeds"].float()), with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: ModelConfig, generator: torch.Generator):
        """Noise in the cached latents' layout and the model folder's own scheduler (``scheduler/``) for
        ``request.steps``: its sigmas, and its ``step`` for ``denoise_step``, as the model's pipeline samples."""
        import torch
        from diffpipe_core.sampling.schedules import stepped_schedule

        channels = self.folder.config(model_config.path, "vae")["latent_channels"]
        frames = (1 + (request.frames - 1) // 4,) if VIDEO else ()
        shape = (1, channels, *frames, request.height // 8, request.width // 8)
        return torch.randn(shape, generator=generator), stepped_schedule(model_config.path, request.steps)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(x_t, t, text_embeds)``, the layout :meth:`prepare_inputs` gives the first layer; ``t`` the scheduler's
        timestep over its ``num_train_timesteps``, as the pipeline gives it."""
        from diffpipe_core.sampling.schedules import schedule_time

        t = schedule_time(schedule, index).float().expand(latents.shape[0])
        return latents.float(), t, text["text_embeds"].float()


plugin = {{class_name}}()  # what the entry point in pyproject.toml names
