"""The HiDream-I1 model plugin (entry point ``hidream``: Full, Dev and Fast) on the core's shared plugin parts.

HiDream-I1 is a sparse (MoE) diffusion transformer: double-stream then single-stream blocks over FLUX.1's VAE latents
in 2x2 patches, conditioned on T5's tokens, one Llama 3.1 hidden layer per block, and pooled CLIP-L + CLIP-G
vectors. No torch import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import
it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_hidream.config import HiDreamConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "HiDreamImageTransformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": "CLIPTextModelWithProjection",  # CLIP-L
    "text_encoder_2": "CLIPTextModelWithProjection",  # OpenCLIP bigG
    "text_encoder_3": "T5EncoderModel",  # T5-XXL
    "text_encoder_4": "LlamaForCausalLM",  # Llama 3.1 8B Instruct: its hidden states, never its head
    "tokenizer": TOKENIZER,
    "tokenizer_2": TOKENIZER,
    "tokenizer_3": TOKENIZER,
    "tokenizer_4": TOKENIZER,
}
TEXT = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3",
        "text_encoder_4", "tokenizer_4")
#: every block's attention linears (image and text) and every SwiGLU linear: the routed and shared experts of the MoE
#: feed-forwards and the double blocks' text feed-forward (``w1``, ``w2``, ``w3``)
BLOCK_LINEARS = (
    *("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out"),
    *("attn1.to_q_t", "attn1.to_k_t", "attn1.to_v_t", "attn1.to_out_t"),
    *("w1", "w2", "w3"),
)


class HiDream(DiffusersModel, FlowSampling):
    """HiDream-I1 Full / Dev / Fast: double- and single-stream MoE blocks on T5 + per-block Llama 3.1 text and a
    pooled CLIP vector; VAE factor 8 x 2x2 patches = multiples of 16 pixels."""
    #: the released size (HiDream-I1, 17 B) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: HiDream-ai/HiDream-I1-Full's transformer/config.json (as ComfyUI's model detection states it); FLUX.1's VAE (16
    #: channels, 8x); T5-XXL's and Llama 3.1 8B's 128 tokens (Llama: all 32 hidden layers cached), pooled 768 + 1280
    plan_size = {
        "transformer": {"patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 16,
                        "num_single_layers": 32, "attention_head_dim": 128, "num_attention_heads": 20,
                        "caption_channels": [4096, 4096], "text_emb_dim": 2048, "num_routed_experts": 4,
                        "num_activated_experts": 2, "axes_dims_rope": [64, 32, 32], "max_resolution": [128, 128],
                        "llama_layers": [*range(32), *([31] * 16)]},
        "vae": {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512]},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0},
        "text": {"t5_embeds": (128, 4096), "llama_embeds": (32, 128, 4096), "pooled": (2048,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_hidream.testing:write_tiny_hidream"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "hidream", HiDreamConfig,
        "HiDream-I1 Full / Dev / Fast (diffusers folder or ComfyUI's single file)",
        encoder_settings=("text_max_length", "llama_4bit"), block_layers=("DoubleLayer", "SingleLayer"),
        spatial_multiple=16,
    )
    folder = DiffusersFolder(
        "hidream",
        ("HiDreamImagePipeline",),
        COMPONENTS,
        single_file_example="hidream_i1_full_fp16.safetensors",
        title="HiDream-I1",
        file_optional={"text_encoder_4": ("lm_head.",)},  # only Llama's hidden states are read
    )
    model_class = "HiDreamImageTransformer2DModel"
    single_file_markers = ("caption_projection.0.linear.weight", "x_embedder.proj.weight")
    single_file_name = "hidream_transformer.safetensors"
    key_tables = "diffpipe_hidream.original"  # ComfyUI's layout (diffusers' names): single files, exports, the LoRA
    file_config = {
        "num_layers": r"(?:^|\.)double_stream_blocks\.(\d+)\.",
        "num_single_layers": r"(?:^|\.)single_stream_blocks\.(\d+)\.",
    }
    lora_target_names = BLOCK_LINEARS
    sample_pipeline = "HiDreamImagePipeline"
    sample_pipeline_settings = {"max_sequence_length": "text_max_length"}

    # ------------------------------------------------------------------------------------------ schedule
    def scheduler_config(self, model_config: HiDreamConfig) -> dict[str, Any]:
        """The folder's ``scheduler/scheduler_config.json`` (empty where it has none)."""
        file = Path(model_config.path) / "scheduler" / "scheduler_config.json"
        return json.loads(file.read_text()) if file.is_file() else {}

    def training_shift(self, model_config: HiDreamConfig) -> float:
        """``shift``, or the folder scheduler's own: ``shift`` (``FlowMatchEulerDiscreteScheduler``), ``flow_shift``
        (``UniPCMultistepScheduler`` with flow sigmas); 1 where it has neither."""
        if model_config.shift is not None:
            return float(model_config.shift)
        found = self.scheduler_config(model_config)
        return float(found.get("flow_shift" if found.get("use_flow_sigmas") else "shift", 1.0) or 1.0)

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: HiDreamConfig, device: torch.device) -> Any:
        """The VAE and the four text encoders in a ``HiDreamImagePipeline`` holding only them, so that the prompt
        embeddings are its ``encode_prompt``'s; Llama quantized to nf4 with ``llama_4bit``."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        names = ["vae", *(n for n in TEXT if not (model_config.llama_4bit and n == "text_encoder_4"))]
        enc = load_components(self.folder, model_config, device, *names)
        if model_config.llama_4bit:
            enc.text_encoder_4 = self.load_llama_4bit(model_config, device)
        enc.text = text_pipeline("HiDreamImagePipeline", **{n: getattr(enc, n) for n in TEXT})
        return enc

    def load_llama_4bit(self, model_config: HiDreamConfig, device: Any) -> Any:
        """``text_encoder_4`` from the folder, its linears quantized to bitsandbytes nf4 computing in
        ``encoder_dtype`` as they are read (diffusion-pipe's ``llama3_4bit``; the core's ``encoder_quantize`` path for
        this one encoder); a clear error without bitsandbytes or with a Llama component file (quantize the folder's
        weights)."""
        import importlib.util

        from diffpipe_core.parts.encoders import quantization_config, torch_dtype

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("[model] llama_4bit = true needs the bitsandbytes package (pip install bitsandbytes)")
        if "text_encoder_4" in self.folder.component_files(model_config.path, model_config):
            raise ValueError("[model] llama_4bit quantizes the folder's text_encoder_4; leave the Llama file out of "
                             "text_encoders, or set llama_4bit = false")
        dtype = torch_dtype(model_config.encoder_dtype)
        return self.folder.load(model_config.path, "text_encoder_4", dtype, device,
                                quantization=quantization_config("nf4", dtype))

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 16, H/8, W/8) as ``(mode - shift_factor) * scaling_factor``, ``mask`` on the latent
        grid. Captions, as ``HiDreamImagePipeline.encode_prompt`` computes them at ``max_sequence_length =
        text_max_length``: ``t5_embeds`` (B, L, 4096), ``llama_embeds`` (B, layers, L, 4096): every Llama hidden layer
        (``hidden_states[1:]``, the padding included: the transformer reads it), ``pooled`` (B, 2048): CLIP-L's and
        CLIP-G's projected vectors side by side. bfloat16 when the encoders run in it, else float32."""
        import torch

        from diffpipe_core.parts.latents import image_vae_latents

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out.update(image_vae_latents(encoders.vae, batch.pixels, batch.masks))
        if batch.captions is not None:
            with torch.no_grad():
                t5, _, llama, _, pooled, _ = encoders.text.encode_prompt(
                    list(batch.captions), device=encoders.device, do_classifier_free_guidance=False,
                    max_sequence_length=encoders.config.text_max_length,
                )
            dtype = torch.bfloat16 if llama.dtype == torch.bfloat16 else torch.float32
            out["t5_embeds"] = t5.to(dtype).cpu()
            out["llama_embeds"] = llama.transpose(0, 1).to(dtype).cpu().contiguous()
            out["pooled"] = pooled.float().cpu()
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: HiDreamConfig) -> list[nn.Module]:
        """The embedders, each double-stream block, each single-stream block, the output head (``layers.py``)."""
        from diffpipe_hidream.layers import split_into_layers

        return split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, t5_embeds, llama_embeds, pooled), (velocity[, mask]))``: rectified flow
        (:func:`diffpipe_core.parts.flow.flow_sample`) shifted by :meth:`training_shift`."""
        from diffpipe_core.parts.flow import flow_sample, with_mask

        cfg: HiDreamConfig = context.model_config  # type: ignore[assignment]
        f = flow_sample(batch["latents"], cfg, context, generator, self.training_shift(cfg))
        inputs = (f.x_t, f.t, batch["t5_embeds"], batch["llama_embeds"], batch["pooled"].float())
        return inputs, with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    def sample_pipeline_setup(self, pipe: Any, request: SampleRequest) -> None:
        """Make ``HiDreamImagePipeline`` sample at ``request``'s size, as diffpipe does: the pipeline rescales every
        size to the area of its ``default_sample_size`` (128 latents: 1024 x 1024) and floors it to 16 pixels, so its
        area is set to the request's (a hair above, so the floor keeps the size)."""
        import math

        pipe.default_sample_size = math.sqrt(request.width * request.height) * (1 + 1e-6) / pipe.vae_scale_factor

    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: HiDreamConfig, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` and the folder's own scheduler for ``request.steps`` (UniPC or flow-matching
        Euler, with the variant's shift), as ``HiDreamImagePipeline`` samples."""
        import torch

        from diffpipe_core.sampling.schedules import stepped_schedule

        noise = torch.randn(self.latent_shape(request, model_config), generator=generator)
        return noise, stepped_schedule(model_config.path, request.steps)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """``(x_t, t, t5_embeds, llama_embeds, pooled)``, the layout :meth:`prepare_inputs` gives the first layer;
        ``t`` the scheduler's timestep over its ``num_train_timesteps``."""
        from diffpipe_core.sampling.schedules import schedule_time

        t = schedule_time(schedule, index).float().expand(latents.shape[0])
        return latents.float(), t, text["t5_embeds"], text["llama_embeds"], text["pooled"].float()


plugin = HiDream()
