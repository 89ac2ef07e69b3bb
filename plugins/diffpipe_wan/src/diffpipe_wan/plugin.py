"""The Wan model plugin (entry point ``wan``: Wan 2.1 T2V 1.3B / 14B, Wan 2.2 TI2V 5B and T2V A14B, text-to-video
on clips and images) on the core's shared plugin parts. ``diffpipe_wan.i2v`` adds ``wan-i2v``.

``prepare_inputs`` gives the first pipeline layer ``(x_t, t, text_embeds)``: the noisy latents ``(B, C, F, h, w)``
(images: F = 1), the flow time ``(B,)`` and the UMT5 embeddings; the loss targets are the velocity and the dataset's
loss mask. This module imports no torch, diffusers or transformers.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.model_files import read_json
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import IMAGE_PROCESSOR, TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_wan.config import DEFAULT_SHIFT, WanConfig
from diffpipe_wan.umt5 import umt5_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "WanTransformer3DModel",
    "transformer_2": "WanTransformer3DModel",
    "vae": "AutoencoderKLWan",
    "text_encoder": ("UMT5EncoderModel", "T5EncoderModel"),
    "tokenizer": TOKENIZER,
    "image_encoder": ("CLIPVisionModel", "CLIPVisionModelWithProjection"),
    "image_processor": IMAGE_PROCESSOR,
}
#: components only some Wan folders have: the second expert (A14B), the image encoder (Wan 2.1 I2V)
OPTIONAL = ("transformer_2", "image_encoder", "image_processor")
SIZES = (
    SizeMatch("text_encoder", "d_model", "text_dim", 4096),
    SizeMatch("vae", "z_dim", "out_channels", 16),
    SizeMatch("image_encoder", "hidden_size", "image_dim"),
)
EXPERTS = {"high": "transformer", "low": "transformer_2"}
#: original layouts of component files: the Wan VAE's (ComfyUI's wan_2.1_vae / wan2.2_vae files), the Wan T5's
#: (Kijai's umt5-xxl-enc-bf16 file)
FILE_LAYOUTS = {"vae": wan_vae_table, "text_encoder": umt5_table}


@lru_cache(maxsize=16)
def _folder_facts(path: str) -> dict[str, Any]:
    """What a Wan folder says about itself: its ``model_index.json`` and the scheduler's config (empty if absent)."""
    index, _ = read_json(Path(path) / "model_index.json")
    scheduler, _ = read_json(Path(path) / "scheduler" / "scheduler_config.json")
    return {"index": index or {}, "scheduler": scheduler or {}}


def present(index: dict[str, Any], component: str) -> bool:
    """Whether ``model_index.json`` lists ``component`` (an optional one is ``[null, null]`` when absent)."""
    entry = index.get(component)
    return isinstance(entry, list) and bool(entry) and entry[0] is not None


def boundary_ratio(path: Path) -> float | None:
    """The two-expert switch of a Wan 2.2 A14B folder (``model_index.json``'s ``boundary_ratio``), or None."""
    index = _folder_facts(str(path))["index"]
    value = index.get("boundary_ratio")
    return float(value) if value is not None and present(index, "transformer_2") else None


def folder_shift(path: Path) -> float:
    """The time shift the folder's scheduler samples with: ``flow_shift`` (UniPC) or ``shift`` (flow-match Euler,
    without dynamic shifting); :data:`DEFAULT_SHIFT` when it names none."""
    scheduler = _folder_facts(str(path))["scheduler"]
    for key in ("flow_shift", "shift"):
        value = scheduler.get(key)
        if isinstance(value, int | float) and value > 0 and not scheduler.get("use_dynamic_shifting"):
            return float(value)
    return DEFAULT_SHIFT


def expert_range(model_config: WanConfig) -> tuple[float, float]:
    """The noise range of the trained transformer: the whole range, or one expert's side of ``boundary_ratio``."""
    if model_config.expert is None:
        return 0.0, 1.0
    ratio = boundary_ratio(model_config.path)
    if ratio is None:
        raise ValueError(expert_problem(model_config, None))
    return (ratio, 1.0) if model_config.expert == "high" else (0.0, ratio)


def expert_problem(model_config: WanConfig, ratio: float | None) -> str | None:
    """What is wrong with ``[model] expert`` for this folder, or None."""
    index_file = model_config.path / "model_index.json"
    if ratio is not None and model_config.expert is None:
        return (
            f"{index_file}: a two-expert Wan 2.2 A14B folder (boundary_ratio {ratio}); set [model] expert = \"high\" "
            f"(trains transformer, times t >= {ratio}) or \"low\" (trains transformer_2, t < {ratio})"
        )
    if ratio is None and model_config.expert is not None:
        return (
            f"{index_file}: [model] expert = {model_config.expert!r} is for Wan 2.2 A14B folders (transformer_2 and "
            "boundary_ratio in model_index.json); this folder has one transformer: leave expert out"
        )
    return None


class Wan(DiffusersModel, FlowSampling):
    """Wan text-to-video: a video model (images train as 1-frame videos); VAE 8x spatial (16x for Wan 2.2 TI2V's)
    x 2x2 patches; 4x temporal, so frame counts are 4k + 1; clips resampled to 16 fps."""
    tiny_writer = "diffpipe_wan.testing:write_tiny_wan"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "wan", WanConfig,
        "Wan 2.1 / 2.2 text-to-video (diffusers folder or original single-file transformer; A14B experts)",
        video=(4, 1, 16.0), encoder_settings=("text_max_length",), block_layers=("BlockLayer",),
    )
    folder = DiffusersFolder(
        "wan",
        ("WanPipeline",),
        COMPONENTS,
        sizes=SIZES,
        single_file_example="wan2.1_t2v_1.3B_fp16.safetensors",
        file_layouts=FILE_LAYOUTS,
    )
    model_class = "WanTransformer3DModel"
    #: the released size (Wan 2.1 T2V 14B) for the model page's GPU-fit table (diffpipe_core.engine.fit_table)
    plan_size = {
        "transformer": {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
                        "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824,
                        "num_layers": 40, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6},
        "vae": {"z_dim": 16, "scale_factor_spatial": 8, "scale_factor_temporal": 4},
        "scheduler": {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
                      "use_flow_sigmas": True, "flow_shift": 5.0, "num_train_timesteps": 1000},
        "text": {"text_embeds": (512, 4096)},
    }  # fmt: skip
    single_file_markers = ("head.modulation", "blocks.0.self_attn.q.weight")
    single_file_name = "wan_transformer.safetensors"
    # 1.3B, 14B or 5B, text- or image-to-video (with or without the CLIP image embedder), in either layout
    file_config = {
        "num_layers": blocks("blocks"),
        "num_attention_heads": Shape(weight_of("patch_embedding"), 0, per="attention_head_dim"),
        "in_channels": Shape(weight_of("patch_embedding"), 1),
        "out_channels": Shape(weight_of("head.head", "proj_out"), 0, per="patch_size"),
        "ffn_dim": Shape(weight_of("blocks.0.ffn.0", "blocks.0.ffn.net.0.proj"), 0),
        "text_dim": Shape(weight_of("text_embedding.0", "condition_embedder.text_embedder.linear_1"), 1),
        "image_dim": Shape(weight_of("img_emb.proj.0", "condition_embedder.image_embedder.norm1"), 0, absent=None),
        "added_kv_proj_dim": Shape(weight_of("blocks.0.cross_attn.k_img", "blocks.0.attn2.add_k_proj"), 1, absent=None),
    }
    key_tables = "diffpipe_wan.original"  # layout_for_config / lora_layout: the original Wan single-file layout
    # the attention (self, cross, and the image-to-video cross-attention's image keys/values) and feed-forward linears
    # of every block; no other module of the model has these names
    lora_target_names = ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2")

    def model_component(self, model_config: WanConfig) -> str:
        """``transformer``, or with ``expert = "low"`` the A14B's ``transformer_2``."""
        return EXPERTS[model_config.expert or "high"]

    # ------------------------------------------------------------------------------------------ files
    def folder_problems(self, model_config: WanConfig) -> list[str]:
        """Problems of this entry point with a folder whose components fit (empty: none)."""
        return []

    def checked_folder(self, model_config: WanConfig) -> DiffusersFolder:
        """The component table without the optional components this folder's ``model_index.json`` does not list."""
        from dataclasses import replace

        index = _folder_facts(str(model_config.path))["index"]
        table = {k: v for k, v in COMPONENTS.items() if k not in OPTIONAL or present(index, k)}
        return replace(self.folder, components=table)

    @hookimpl
    def validate_model_files(self, model_config: WanConfig) -> list[str]:
        """``expert`` first, then the shared checks (:meth:`checked_folder`'s components, the trained transformer's
        weights or ``diffusion_model``, the components' sizes), this entry point's own and the training time range;
        no weight is read."""
        expert = expert_problem(model_config, boundary_ratio(model_config.path))
        if expert:
            return [expert]
        found = super().validate_model_files(model_config) or self.folder_problems(model_config)
        if not found:
            try:
                model_config.time_range(expert_range(model_config))
            except ValueError as exc:
                found.append(f"{model_config.path}: {exc}")
        return found

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: WanConfig, device: torch.device) -> Any:
        """``AutoencoderKLWan``, the UMT5 encoder and its tokenizer, from the folder."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_wan.encoding import pixel_multiple

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.multiple = pixel_multiple(enc.vae.config, self.model_folder_config(model_config))
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, z, F', H/s, W/s) normalised per channel with the VAE's ``latents_mean`` /
        ``latents_std`` (the inverse of the pipelines' decoding; images are one frame), ``mask`` (B, 1, 1, h, w) when
        given. Captions: ``text_embeds`` (B, text_max_length, d) as ``WanPipeline.encode_prompt`` makes them (the
        caption cleaned, UMT5 with its attention mask, the padding positions zeroed)."""
        from diffpipe_wan.encoding import text

        out = self.encode_media(encoders, batch) if batch.pixels is not None else {}
        if batch.captions is not None:
            out["text_embeds"] = text(encoders, batch.captions)
        return out

    def encode_media(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """``latents`` and ``mask`` of a media batch (:meth:`encode_batch`)."""
        from diffpipe_wan import encoding

        pixels, masks = encoding.fit_to_patches(batch.pixels, batch.masks, encoders)
        out = {"latents": encoding.latents(encoders.vae, pixels)}
        if masks is not None:
            out["mask"] = encoding.loss_mask(masks, out["latents"])
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: WanConfig) -> list[nn.Module]:
        """Embedders (patch, time, text, rotary), each transformer block, the head."""
        from diffpipe_wan.layers import split_into_layers

        return split_into_layers(model)

    def flow_settings(self, model_config: WanConfig) -> tuple[float, tuple[float, float]]:
        """``(shift, (min_t, max_t))`` of training times: ``shift`` or the folder scheduler's; ``min_t`` / ``max_t``
        where given, else the trained expert's range."""
        shift = model_config.shift if model_config.shift is not None else folder_shift(model_config.path)
        return shift, model_config.time_range(expert_range(model_config))

    def noisy(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator) -> Any:
        """The rectified-flow sample of the batch's latents (:func:`diffpipe_core.parts.flow.flow_sample`)."""
        from diffpipe_core.parts.flow import flow_sample

        cfg: WanConfig = context.model_config  # type: ignore[assignment]
        shift, time_range = self.flow_settings(cfg)
        return flow_sample(batch["latents"], cfg, context, generator, shift, time_range)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds), (velocity[, mask]))`` (module docstring); all randomness from ``generator``."""
        from diffpipe_core.parts.flow import with_mask

        f = self.noisy(batch, context, generator)
        return (f.x_t, f.t, batch["text_embeds"].float()), with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: WanConfig, generator: torch.Generator):
        """Noise ``(1, z, (F - 1) / 4 + 1, H / s, W / s)`` (sizes rounded down to the VAE factor x patch, as the
        pipelines round them) and the folder's own scheduler for ``request.steps`` steps, stepped as the pipelines step
        it (UniPC in the released folders: its multistep updates, not Euler on its sigmas)."""
        import torch

        from diffpipe_core.sampling.schedules import stepped_schedule
        from diffpipe_wan.encoding import latent_shape

        vae = self.folder.config(model_config.path, "vae")
        shape = latent_shape(vae, self.model_folder_config(model_config), request)
        return torch.randn(shape, generator=generator), stepped_schedule(model_config.path, request.steps)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds)``, ``t`` the scheduler's timestep (over 1000) as the pipelines give
        it."""
        from diffpipe_core.sampling.schedules import schedule_time

        t = schedule_time(schedule, index).float().expand(latents.shape[0])
        return latents.float(), t, text["text_embeds"].float()

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """``latents / (1 / latents_std) + latents_mean``, as the Wan pipelines decode."""
        from diffpipe_wan.encoding import denormalize

        return denormalize(latents, vae)


wan = Wan()
