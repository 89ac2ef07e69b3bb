"""``cosmos-predict2.5``: NVIDIA Cosmos-Predict2.5 text-to-world (videos, and images as 1-frame videos), on
Predict2's parts, as ``Cosmos2_5_PredictBasePipeline`` computes it.

What 2.5 changes over Predict2 (:class:`~diffpipe_cosmos.plugin.Predict2`):

- text: Qwen2.5-VL (NVIDIA's Cosmos-Reason1) over a chat-templated caption padded to ``text_max_length``, every
  hidden state after the embeddings normalised over its features and concatenated (``text_embeds`` ``(B, L,
  layers * hidden)``); the transformer's own ``crossattn_proj`` maps them to its cross-attention width;
- the transformer: ``in_channels`` = latent channels + 1 (a condition-mask channel, zeros for text-to-world; the
  layers add it), no frame rate given to its RoPE;
- time: the model sees ``x_t = (1 - t) x_0 + t noise`` at timestep ``t`` in [0, 1] and predicts the velocity
  ``noise - x_0`` (the pipeline's ``sigma_t`` and flow-prediction scheduler), so training is Predict2's;
- sampling: the folder's ``UniPCMultistepScheduler`` (flow sigmas on a Karras ramp), stepped by diffusers' own
  ``step`` (:func:`diffpipe_core.sampling.schedules.stepped_schedule`); the pipeline's ``guidance_scale`` s is
  ``[sample] cfg`` = 1 + s, as for Predict2.

The transformer's blocks are Predict2's, so the ComfyUI LoRA has Predict2's keys. This module imports no torch,
diffusers or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import diffusers_spec
from diffpipe_cosmos.config import Predict25Config
from diffpipe_cosmos.plugin import BLOCKS, SIZES_720P, Predict2

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.parts.layout import KeyTable
    from diffpipe_core.types import SampleRequest

PIPELINE = "Cosmos2_5_PredictBasePipeline"
#: the system turn of the pipeline's ``_get_prompt_embeds`` conversation
SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."


class Predict25(Predict2):
    """Cosmos-Predict2.5 (module docstring): Predict2's latents, layers, loss and LoRA layout; its own text
    encoder, inputs and sampler."""
    #: the released size (Cosmos-Predict2.5-2B) for the GPU-fit table: Predict2 2B's blocks with the
    #: condition-mask channel (in_channels 17), RoPE scale 1/3/3 and the cross-attention projection of
    #: Cosmos-Reason1-7B's 28 hidden layers x 3584 (100352) to 1024; the Wan 2.1 VAE; text_max_length's default 512
    plan_size = {
        "transformer": {"in_channels": 17, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
                        "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
                        "max_size": [128, 240, 240], "patch_size": [1, 2, 2], "rope_scale": [1.0, 3.0, 3.0],
                        "concat_padding_mask": True, "extra_pos_embed_type": None, "use_crossattn_projection": True,
                        "crossattn_proj_in_channels": 100352, "encoder_hidden_states_channels": 1024},
        "vae": {"z_dim": 16, "scale_factor_spatial": 8, "scale_factor_temporal": 4},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 1.0},
        "text_encoder": {"hidden_size": 3584, "num_hidden_layers": 28},
        "text": {"text_embeds": (512, 100352)},
    }  # fmt: skip
    tiny_writer = "diffpipe_cosmos.testing_predict25:write_tiny_predict25"  # python -m ...testing.tiny_models

    variant: ClassVar[Any] = "predict2.5"
    default_fps = 16.0
    trained = ((1, 93), SIZES_720P)
    spec = diffusers_spec(
        "cosmos-predict2.5",
        Predict25Config,
        "NVIDIA Cosmos-Predict2.5 text-to-world, images as 1-frame videos (diffusers folder)",
        video=(4, 1, 16),
        encoder_settings=("text_max_length",),
        block_layers=BLOCKS,
        model_formats=("diffusers",),
    )
    folder = DiffusersFolder(
        "cosmos-predict2.5",
        (PIPELINE,),
        {
            "transformer": "CosmosTransformer3DModel",
            "vae": "AutoencoderKLWan",
            "text_encoder": "Qwen2_5_VLForConditionalGeneration",
            "tokenizer": TOKENIZER,
        },
    )

    def original_layout(self, transformer_config: dict[str, Any]) -> KeyTable | None:
        """None: no original single file (:class:`~diffpipe_cosmos.config.Predict25Config`)."""
        return None

    def lora_layout(self, state_dict: dict[str, torch.Tensor]) -> KeyTable:
        """Predict2's NVIDIA block names (2.5's blocks are Predict2's): the ComfyUI LoRA's keys."""
        from diffpipe_core.parts.layout import count_blocks
        from diffpipe_cosmos.nvidia import layout

        return layout("predict2", count_blocks(state_dict, r"transformer_blocks\.(\d+)\."))

    @hookimpl
    def validate_model_files(self, model_config: Predict25Config) -> list[str]:
        """The folder's structure, and the text encoder's concatenated hidden states fitting the transformer's
        ``crossattn_proj`` (read from the two configs)."""
        return super().validate_model_files(model_config) or self.text_size_problems(model_config)

    def text_size_problems(self, model_config: Predict25Config) -> list[str]:
        path = model_config.path
        encoder = self.folder.config(path, "text_encoder")
        text = encoder.get("text_config") or encoder
        width = int(text["hidden_size"]) * int(text["num_hidden_layers"])
        transformer = self.model_folder_config(model_config)
        if transformer.get("use_crossattn_projection") and transformer.get("crossattn_proj_in_channels") == width:
            return []
        return [
            f"{path / 'transformer' / 'config.json'}: crossattn_proj_in_channels "
            f"{transformer.get('crossattn_proj_in_channels')} (use_crossattn_projection "
            f"{transformer.get('use_crossattn_projection')}); the text encoder's {text['num_hidden_layers']} layers x "
            f"hidden_size {text['hidden_size']} ({path / 'text_encoder' / 'config.json'}) need {width}"
        ]

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media as Predict2 (``latents``, ``mask``); captions: ``text_embeds`` (:func:`prompt_embeds`)."""
        import dataclasses

        out = super().encode_batch(encoders, dataclasses.replace(batch, captions=None))
        if batch.captions is not None:
            length = encoders.config.text_max_length
            out["text_embeds"] = prompt_embeds(encoders.text_encoder, encoders.tokenizer, batch.captions, length)
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: Predict25Config) -> list[nn.Module]:
        """Predict2's layers, without a frame rate for the RoPE (the pipeline gives none)."""
        from diffpipe_cosmos import layers

        return layers.split_into_layers(model, None)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds), (noise - x_0, weight[, mask]))``: Predict2's rectified flow."""
        import torch

        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_cosmos.plugin import nvidia_weight

        cfg: Predict25Config = context.model_config  # type: ignore[assignment]
        f = flow_sample(batch["latents"], cfg, context, generator)
        weight = nvidia_weight(f.t) if cfg.nvidia_weighting else torch.ones(f.t.shape[0])
        return (f.x_t, f.t, batch["text_embeds"].float()), with_mask((f.target, weight), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: Predict25Config, generator: torch.Generator):
        """Noise ``(1, C, (F - 1) / 4 + 1, H / 8, W / 8)`` and the folder's UniPC schedule (its flow sigmas)."""
        import torch

        from diffpipe_core.sampling.schedules import stepped_schedule

        temporal, spatial = self.vae_factors(model_config)
        channels = int(self.model_folder_config(model_config).get("out_channels", 16))
        shape = (1, channels, (request.frames - 1) // temporal + 1, request.height // spatial, request.width // spatial)
        return torch.randn(shape, generator=generator), stepped_schedule(model_config.path, request.steps)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(x_t, t, text_embeds)`` at the schedule's sigma ``t`` (the pipeline's ``sigma_t`` timestep)."""
        t = schedule[index].float().expand(latents.shape[0])
        return latents.float(), t, text["text_embeds"].float()

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """The folder scheduler's own step (UniPC multistep)."""
        from diffpipe_core.sampling.schedules import scheduler_step

        return scheduler_step(latents, prediction, schedule, index)


def conversation(caption: str) -> list[dict[str, Any]]:
    """The chat the pipeline templates for one caption: its system turn, then the caption as the user's."""
    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
        {"role": "user", "content": [{"type": "text", "text": caption}]},
    ]


def prompt_embeds(encoder: Any, tokenizer: Any, captions: list[str], max_length: int) -> torch.Tensor:
    """``(B, max_length, layers * hidden)`` float32 on the CPU: each caption's chat (:func:`conversation`) padded or
    truncated to ``max_length`` tokens, run without a mask, and every hidden state but the embeddings' normalised to
    zero mean and unit (unbiased) standard deviation over its features, side by side, as the pipeline's
    ``_get_prompt_embeds``."""
    import torch

    rows = []
    for caption in captions:
        ids = tokenizer.apply_chat_template(
            conversation(caption),
            tokenize=True,
            add_generation_prompt=False,
            add_vision_id=False,
            max_length=max_length,
            truncation=True,
            padding="max_length",
        )
        rows.append(torch.as_tensor(ids["input_ids"] if not isinstance(ids, list) and "input_ids" in ids else ids))
    device = next(encoder.parameters()).device
    with torch.no_grad():
        states = encoder(torch.stack(rows).to(device), output_hidden_states=True).hidden_states[1:]
        normalised = [(h - h.mean(dim=-1, keepdim=True)) / (h.std(dim=-1, keepdim=True) + 1e-8) for h in states]
        return torch.cat(normalised, dim=-1).float().cpu()


predict25 = Predict25()
