"""``anima``: Anima (CircleStone Labs and Comfy Org), a Cosmos-Predict2 transformer with an LLM adapter, as diffusers'
``AnimaModularPipeline`` computes it, on the Cosmos plugins' parts.

What Anima changes over Predict2 (:class:`~diffpipe_cosmos.plugin.Predict2`):

- text: Qwen3 (0.6B)'s last hidden state of each caption (zero past it) and the caption's T5 token ids, both
  ``padding="longest"`` up to ``text_max_length``, as ``AnimaTextEncoderStep.encode_prompt`` (called itself); the LLM
  adapter (diffusers' ``AnimaTextConditioner``, the pipeline's ``text_conditioner``) maps them to the transformer's
  text in the first layer. The adapter is part of the trained model (a held component: ``text_conditioner.*``),
  parameter group ``llm_adapter``, frozen unless ``[model] llm_adapter_lr`` gives it a rate;
- latents: Qwen-Image's VAE, an image as one frame, ``(z - latents_mean) / latents_std``;
- time: rectified flow, the transformer sees ``x_t`` at ``t`` in [0, 1] and predicts ``noise - x_0``; samples step the
  folder's ``FlowMatchEulerDiscreteScheduler`` through ``linspace(1, 1/steps, steps)`` with its shift, and CFG is the
  pipeline's guider's ``guidance_scale`` (``[sample] cfg``, the same convention).

This module imports no torch, diffusers or transformers; each hook imports what does the work when it is called.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling, FrameVAEDecoding
from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_cosmos.config import AnimaConfig
from diffpipe_cosmos.plugin import BLOCKS, LORA_TARGETS, Cosmos, Predict2

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.parts.layout import KeyTable
    from diffpipe_core.types import SampleRequest

PIPELINE = "AnimaModularPipeline"
ADAPTER = "text_conditioner"  # the LLM adapter's component (and parameter prefix)
COMPONENTS = {
    "transformer": "CosmosTransformer3DModel",
    ADAPTER: "AnimaTextConditioner",
    "vae": "AutoencoderKLQwenImage",
    "text_encoder": ("Qwen3Model", "Qwen3ForCausalLM"),
    "tokenizer": TOKENIZER,
    "t5_tokenizer": TOKENIZER,
}
#: the cached text: Qwen3's states and mask, the T5 ids and mask
TEXT_KEYS = ("qwen_embeds", "qwen_mask", "t5_ids", "t5_mask")


class Anima(DiffusersModel, FrameVAEDecoding, FlowSampling):
    """Anima (module docstring): Predict2's transformer and layers after the LLM adapter, Qwen-Image's latents,
    flow-matching training and ``AnimaModularPipeline``'s sampler."""
    #: the released size (Anima, circlestone-labs/Anima-Base-v1.0-Diffusers) for the GPU-fit table
    #: (diffpipe_core.engine.fit_table): diffusers' scripts/convert_anima_to_diffusers.py builds the transformer from
    #: convert_cosmos_to_diffusers.py's "Cosmos-2.0-Diffusion-2B-Text2Image" config (Predict2 2B's) and the scheduler
    #: at shift 3; the LLM adapter at AnimaTextConditioner's defaults (ComfyUI's LLMAdapter: 6 blocks of 1024 over
    #: Qwen3 0.6B's 1024, T5's 32128 ids); Qwen-Image's VAE (16 channels, 8x); Qwen3 and T5 tokens at
    #: text_max_length's default 512
    plan_size = {
        "transformer": Predict2.plan_size["transformer"],
        ADAPTER: {"source_dim": 1024, "target_dim": 1024, "model_dim": 1024, "num_layers": 6,
                  "num_attention_heads": 16, "mlp_ratio": 4.0, "target_vocab_size": 32128,
                  "use_self_attention": True, "use_layer_norm": False},
        "vae": {"z_dim": 16, "temperal_downsample": [False, True, True]},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0},
        "text": {"qwen_embeds": (512, 1024), "qwen_mask": (512,), "t5_ids": (512,), "t5_mask": (512,)},
    }  # fmt: skip

    tiny_writer = "diffpipe_cosmos.testing_anima:write_tiny_anima"  # python -m diffpipe_core.testing.tiny_models
    spec = diffusers_spec(
        "anima", AnimaConfig,
        "Anima text-to-image (a Cosmos-Predict2 transformer with an LLM adapter; diffusers folder or ComfyUI's file)",
        encoder_settings=("text_max_length",), block_layers=BLOCKS, spatial_multiple=16,
    )
    folder = DiffusersFolder(
        "anima", (PIPELINE,), COMPONENTS, single_file_example="anima-base.safetensors", title="Anima",
        file_layouts={"vae": wan_vae_table},  # ComfyUI's qwen_image_vae.safetensors: the Wan VAE's layout
        file_optional={"text_encoder": ("lm_head.",)},  # Qwen3's language-model head is never run
    )
    model_class = "CosmosTransformer3DModel"
    key_tables = "diffpipe_cosmos.anima_files"
    single_file_markers = ("blocks.0.mlp.layer1.weight", "llm_adapter.blocks.0.cross_attn.q_proj.weight")
    single_file_name = "anima.safetensors"
    file_config = Cosmos.file_config
    lora_target_names = LORA_TARGETS

    def held_components(self, model_config: AnimaConfig) -> tuple[str, ...]:
        """The LLM adapter: part of the model, in the first pipeline stage."""
        return (ADAPTER,)

    def component_layout(self, model_config: AnimaConfig, component: str) -> KeyTable | None:
        """The adapter's part of the single file (``net.llm_adapter.*``)."""
        from diffpipe_cosmos.anima_files import adapter_table

        return adapter_table() if component == ADAPTER else None

    def adapter_key_map(self, model_config: AnimaConfig) -> Callable[[str], Any]:
        """The key map of the adapter's tensors in the single file (names under ``text_conditioner.``): a linear
        quantized in an fp8 scaled or int8 file is dequantized (the adapter runs, and may train, in full precision),
        its scales and markers skipped."""
        import torch

        from diffpipe_core.component_files import read_component_file
        from diffpipe_core.quantized_files import dequantizing, is_scale_key, is_side_key
        from diffpipe_cosmos.anima_files import adapter_table

        single = Path(self.single_file(model_config))  # type: ignore[arg-type]
        file = read_component_file(single, "diffusion_model")
        base = adapter_table().key_map(list(file.tensors), ADAPTER)
        quantized = {q.weight: q for q in file.quantized.values()}

        def mapped(key: str) -> Any:
            if is_side_key(key) or is_scale_key(key):
                return None
            name = base(key)
            layer = quantized.get(key)
            return [(name, dequantizing(single, layer, torch.float32))] if name and layer else name

        return mapped

    @hookimpl
    def diffusion_model_weights(self, model_config: AnimaConfig) -> list[tuple[Path, Callable[[str], Any]]]:
        """The folder's weight files, or the single file through the transformer's table and
        :meth:`adapter_key_map`."""
        found = super().diffusion_model_weights(model_config)
        single = self.single_file(model_config)
        return found if single is None else [*found[:-1], (Path(single), self.adapter_key_map(model_config))]

    def load_component(self, model_config: AnimaConfig, component: str, dtype: torch.dtype, device: Any) -> Any:
        """The adapter from the single file through :meth:`adapter_key_map` (other components, or the folder's
        adapter, as the base class loads them). Missing or unexpected tensors raise, naming the file."""
        import torch
        from safetensors import safe_open

        single = self.single_file(model_config)
        if component != ADAPTER or single is None or torch.device(device).type == "meta":
            return super().load_component(model_config, component, dtype, device)
        model = self.folder.skeleton(self.model_folder(model_config), ADAPTER, dtype)
        target, key_map, state = model.state_dict(), self.adapter_key_map(model_config), {}
        with safe_open(str(single), framework="pt") as f:
            for key in f.keys():
                made = key_map(key)
                for name, fn in [(made, None)] if isinstance(made, str) else made or []:
                    value = f.get_tensor(key)
                    state[name[len(ADAPTER) + 1 :]] = fn(value) if fn else value
        missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
        if missing or unexpected:
            raise KeyError(f"{single}: the LLM adapter's tensors (net.llm_adapter.*) do not fit "
                           f"{self.model_folder(model_config) / ADAPTER / 'config.json'}: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
        model.load_state_dict({k: v.to(target[k].dtype) for k, v in state.items()}, assign=True)
        return model.to(device).eval().requires_grad_(False)

    def default_lora_targets(self, model_config: AnimaConfig) -> list[str]:
        """The transformer blocks' attention and MLP linears (Predict2's); with ``llm_adapter_lr`` above 0 also every
        adapter block's linears, by full name (diffusion-pipe's ``LLMAdapterTransformerBlock`` targets)."""
        from diffpipe_cosmos.anima_files import ADAPTER_LINEARS

        targets = list(LORA_TARGETS)
        if model_config.llm_adapter_lr > 0:
            count = int(self.folder.config(self.model_folder(model_config), ADAPTER).get("num_layers", 6))
            targets += [f"{ADAPTER}.blocks.{i}.{name}" for i in range(count) for name in ADAPTER_LINEARS]
        return targets

    @hookimpl
    def parameter_groups(self, model_config: AnimaConfig) -> dict[str, list[str]]:
        """``transformer`` (everything else) and ``llm_adapter`` (the adapter's parameters, LoRA's included)."""
        return {"transformer": [], "llm_adapter": [rf"{ADAPTER}\."]}

    @hookimpl
    def group_lr_defaults(self, model_config: AnimaConfig) -> dict[str, float]:
        """``llm_adapter`` at ``[model] llm_adapter_lr`` (0, the default, freezes it)."""
        return {"llm_adapter": model_config.llm_adapter_lr}

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: AnimaConfig, device: torch.device) -> Any:
        """The VAE, Qwen3 and both tokenizers."""
        from diffpipe_core.parts.encoders import load_components

        return load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer", "t5_tokenizer")

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 16, H/8, W/8), the pipeline's normalised latents of the image as one frame, and
        ``mask``. Captions: :func:`encode_text` (``AnimaTextEncoderStep.encode_prompt``), padded to
        ``text_max_length``."""
        from diffpipe_core.parts.latents import frame_vae_latents

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out.update(frame_vae_latents(encoders.vae, batch.pixels, batch.masks))
        if batch.captions is not None:
            out.update(encode_text(encoders, list(batch.captions), encoders.config.text_max_length))
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: AnimaConfig) -> list[nn.Module]:
        """The adapter and the embedding, each block, the final layer (:mod:`diffpipe_cosmos.anima_layers`)."""
        from diffpipe_cosmos import anima_layers

        return anima_layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, *text), (noise - x_0[, mask]))``, latents as one frame; the text cut to the micro-batch's
        longest caption (the rest is masked padding)."""
        from diffpipe_core.parts.flow import flow_sample, with_mask

        f = flow_sample(batch["latents"], context.model_config, context, generator)  # type: ignore[arg-type]
        targets = with_mask((f.target.unsqueeze(2),), batch, lambda m: m.unsqueeze(2))
        return (f.x_t.unsqueeze(2), f.t, *text_inputs(batch)), targets

    # ------------------------------------------------------------------------------------------ sampling
    def num_train_timesteps(self, model_config: AnimaConfig) -> int:
        file = Path(model_config.path) / "scheduler" / "scheduler_config.json"
        return int((json.loads(file.read_text()) if file.is_file() else {}).get("num_train_timesteps", 1000))

    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: AnimaConfig, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` as the pipeline's ``prepare_latents`` draws its one frame, and the sigmas its
        scheduler makes of ``linspace(1, 1/steps, steps)``."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        factor = 2 ** len(self.folder.config(model_config.path, "vae")["temperal_downsample"])
        c = int(self.model_folder_config(model_config)["in_channels"])
        noise = torch.randn((1, c, request.height // factor, request.width // factor), generator=generator)
        return noise, scheduler_flow_sigmas(model_config.path, np.linspace(1.0, 1 / request.steps, request.steps))

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's inputs at ``schedule[index]``: the pipeline's ``timestep / num_train_timesteps``."""
        n = self.num_train_timesteps(model_config)
        t = (schedule[index].float() * n / n).expand(latents.shape[0])
        return (latents.float().unsqueeze(2), t, *text_inputs(text))

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return prediction[:, :, 0]

    # ------------------------------------------------------------------------------------------ exports
    @hookimpl
    def export_model(self, saved_dir: Path, model_config: AnimaConfig, out_dir: Path, format: str) -> bool | None:
        """``diffusers``: ``out_dir/transformer`` and ``out_dir/text_conditioner`` (the trained adapter) as diffusers
        folders; ``single_file``: ``out_dir/anima.safetensors`` in ComfyUI's layout (``net.`` keys, the adapter under
        ``net.llm_adapter.``), as diffusion-pipe saves Anima."""
        from diffpipe_core.atomic import atomic_save_safetensors
        from diffpipe_core.engine.saving import read_saved_model
        from diffpipe_core.parts.export import split_components
        from diffpipe_cosmos.anima_files import adapter_table

        if format not in ("diffusers", "single_file"):
            return None
        parts = split_components(read_saved_model(saved_dir), "transformer", (ADAPTER,))
        folder, out_dir = self.model_folder(model_config), Path(out_dir)
        if format == "diffusers":
            for part, state in parts.items():
                (out_dir / part).mkdir(parents=True, exist_ok=True)
                (out_dir / part / "config.json").write_bytes((folder / part / "config.json").read_bytes())
                atomic_save_safetensors(state, out_dir / part / "diffusion_pytorch_model.safetensors", {"format": "pt"})
            return True
        state = self.layout_for(model_config).to_original(parts["transformer"])
        state.update(adapter_table().to_original(parts[ADAPTER]))
        atomic_save_safetensors(state, out_dir / self.single_file_name, {"format": "pt"})
        return True


def encode_text(encoders: Any, captions: list[str], length: int) -> dict[str, torch.Tensor]:
    """``AnimaTextEncoderStep.encode_prompt`` itself (its Qwen3 states zeroed past each caption, its T5 token ids;
    both ``padding="longest"``, truncated to ``length``), each padded to ``length``: ``qwen_embeds`` (B, length, d;
    bfloat16 when Qwen3 runs in it), ``qwen_mask``, ``t5_ids``, ``t5_mask`` (B, length), on the CPU."""
    from types import SimpleNamespace

    import torch
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    parts = SimpleNamespace(text_encoder=encoders.text_encoder, tokenizer=encoders.tokenizer,
                            t5_tokenizer=encoders.t5_tokenizer)
    dtype = next(encoders.text_encoder.parameters()).dtype
    with torch.no_grad():
        got = AnimaTextEncoderStep.encode_prompt(parts, captions, prepare_unconditional_embeds=False,
                                                 max_sequence_length=length, device=encoders.device, dtype=dtype)
    embeds = got["qwen_prompt_embeds"].cpu()
    out = {
        "qwen_embeds": padded(embeds.to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32), length),
        "qwen_mask": padded(got["qwen_attention_mask"].cpu().long(), length),
        "t5_ids": padded(got["t5_input_ids"].cpu().long(), length),
        "t5_mask": padded(got["t5_attention_mask"].cpu().long(), length),
    }
    return out


def padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` (B, n, ...) with zeros after its ``n`` positions up to ``length``."""
    import torch

    pad = t.new_zeros((t.shape[0], length - t.shape[1], *t.shape[2:]))
    return torch.cat([t, pad], dim=1)


def text_inputs(text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``(qwen, qwen_mask, t5_ids, t5_mask)`` of cached text, each cut to the longest caption among its rows (its
    Qwen3 and its T5 tokens counted apart): what ``padding="longest"`` gives for those captions."""
    q = max(1, int(text["qwen_mask"].sum(dim=1).max()))
    n = max(1, int(text["t5_mask"].sum(dim=1).max()))
    return (text["qwen_embeds"][:, :q].float(), text["qwen_mask"][:, :q].long(), text["t5_ids"][:, :n].long(),
            text["t5_mask"][:, :n].long())


anima = Anima()
