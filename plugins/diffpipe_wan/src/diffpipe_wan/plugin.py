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
#: how the saved files name each expert (as ComfyUI's and the community's Wan 2.2 files: *_high_noise_*, *_low_noise_*)
EXPERT_FILES = {"high": "high_noise", "low": "low_noise"}
LOW_PREFIX = "transformer_2."  # the low-noise expert's parameters in an expert = "both" run
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


def expert_of(model_config: WanConfig) -> str | None:
    """The expert(s) a run trains: ``[model] expert``, else ``"both"`` for a two-expert A14B folder (None: a folder
    with one transformer)."""
    if model_config.expert is not None:
        return model_config.expert
    return "both" if boundary_ratio(model_config.path) is not None else None


def expert_range(model_config: WanConfig) -> tuple[float, float]:
    """The noise range of the trained transformer: the whole range (one transformer, or both experts), or one
    expert's side of ``boundary_ratio``."""
    expert = expert_of(model_config)
    if expert in (None, "both"):
        return 0.0, 1.0
    ratio = boundary_ratio(model_config.path)
    if ratio is None:
        raise ValueError(expert_problem(model_config, None))
    return (ratio, 1.0) if expert == "high" else (0.0, ratio)


def expert_label(model_config: WanConfig, expert: str) -> dict[str, str]:
    """What a saved file of ``expert`` (``"high"`` / ``"low"``) says about itself: its metadata and
    ``adapter_config.json`` keys ``diffpipe.expert`` (``high_noise`` / ``low_noise``), ``diffpipe.component`` and a
    ``diffpipe.part`` sentence (the run's summary prints it)."""
    ratio = boundary_ratio(model_config.path)
    side = f"t >= {ratio:g}" if expert == "high" else f"t < {ratio:g}"
    component = EXPERTS[expert]
    load = "load_lora_weights(...)" if expert == "high" else "load_lora_weights(..., load_into_transformer_2=True)"
    part = f"Wan 2.2 A14B {EXPERT_FILES[expert].replace('_', '-')} expert ({component}, {side}; WanPipeline.{load})"
    return {"diffpipe.expert": EXPERT_FILES[expert], "diffpipe.component": component, "diffpipe.part": part}


def expert_problem(model_config: WanConfig, ratio: float | None) -> str | None:
    """What is wrong with ``[model] expert`` (and ``diffusion_model_2``) for this folder, or None."""
    index_file = model_config.path / "model_index.json"
    if ratio is None and model_config.expert is not None:
        return (
            f"{index_file}: [model] expert = {model_config.expert!r} is for Wan 2.2 A14B folders (transformer_2 and "
            "boundary_ratio in model_index.json); this folder has one transformer: leave expert out"
        )
    both = expert_of(model_config) == "both"
    if model_config.expert_lr and not both:
        return (
            f"[model] expert_lr = {dict(model_config.expert_lr)} sets the learning rates of an expert = \"both\" run's "
            f"two experts; this run trains {model_config.expert or 'one transformer'!r} alone: leave expert_lr out "
            "([optimizer] lr is its rate)"
        )
    if model_config.diffusion_model_2 is not None and not both:
        return (
            f"[model] diffusion_model_2 = {str(model_config.diffusion_model_2)!r} is the low-noise expert's file of an "
            f"expert = \"both\" run (an A14B folder); this run trains expert {model_config.expert!r}: leave it out "
            "(with expert = \"low\", diffusion_model is transformer_2's file)"
        )
    if both and (model_config.diffusion_model is None) != (model_config.diffusion_model_2 is None):
        given, other = (("diffusion_model", "diffusion_model_2") if model_config.diffusion_model is not None
                        else ("diffusion_model_2", "diffusion_model"))  # fmt: skip
        return (
            f"{index_file}: [model] {given} is set but {other} is not: expert = \"both\" (the default for this A14B "
            f"folder, boundary_ratio {ratio}) trains both transformers; give diffusion_model (transformer, the "
            "high_noise file) and diffusion_model_2 (transformer_2, the low_noise file), or neither, or set expert = "
            '"high" or "low" to train the one file'
        )
    return None


class Wan(DiffusersModel, FlowSampling):
    """Wan text-to-video: a video model (images train as 1-frame videos); VAE 8x spatial (16x for Wan 2.2 TI2V's)
    x 2x2 patches; 4x temporal, so frame counts are 4k + 1; clips resampled to 16 fps."""
    tiny_writer = "diffpipe_wan.testing:write_tiny_wan"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "wan", WanConfig,
        "Wan 2.1 / 2.2 text-to-video (diffusers folder or original single-file transformer; A14B experts)",
        video=(4, 1, 16.0), encoder_settings=("text_max_length",), block_layers=("BlockLayer", "ExpertBlocks"),
        sequence_tensors=((0, 1), (4, 1), (5, 1)),  # the video tokens and their rotary cos / sin (layers.py)
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
        "pos_embed_seq_len": Shape(r"(?:^|\.)(?:img_emb\.emb_pos|image_embedder\.pos_embed)$", 1, absent=None),  # FLF2V
    }
    key_tables = "diffpipe_wan.original"  # layout_for_config / lora_layout: the original Wan single-file layout
    # the attention (self, cross, and the image-to-video cross-attention's image keys/values) and feed-forward linears
    # of every block; no other module of the model has these names
    lora_target_names = ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2")

    def model_component(self, model_config: WanConfig) -> str:
        """``transformer``, or with ``expert = "low"`` the A14B's ``transformer_2`` (with ``"both"``, ``transformer``
        holding ``transformer_2``: :meth:`held_components`)."""
        return EXPERTS.get(expert_of(model_config) or "high", "transformer")

    def held_components(self, model_config: WanConfig) -> tuple[str, ...]:
        """``expert = "both"``: the high-noise ``transformer`` holds the low-noise ``transformer_2`` (its parameters
        are ``transformer_2.<name>``, loaded per stage from its folder or ``diffusion_model_2``)."""
        return ("transformer_2",) if expert_of(model_config) == "both" else ()

    def low_expert_config(self, model_config: WanConfig) -> WanConfig:
        """The run's ``[model]`` table as an ``expert = "low"`` run (``transformer_2`` from ``diffusion_model_2``)."""
        return model_config.model_copy(
            update={"expert": "low", "diffusion_model": model_config.diffusion_model_2, "diffusion_model_2": None}
        )

    def load_component(self, model_config: WanConfig, component: str, dtype: torch.dtype, device: Any) -> Any:
        """``transformer_2`` (``expert = "both"``) as an ``expert = "low"`` run loads it; the rest as the base does."""
        if component == "transformer_2":
            return self.load_diffusion_model(self.low_expert_config(model_config), device, dtype)
        return super().load_component(model_config, component, dtype, device)

    @hookimpl
    def diffusion_model_weights(self, model_config: WanConfig) -> list[tuple[Path, Any]]:
        """Per-stage loading; with ``expert = "both"`` the high-noise transformer's and, named under
        ``transformer_2.``, the low-noise one's (each from the folder or its single file)."""
        if expert_of(model_config) != "both" or model_config.diffusion_model is None:
            return super().diffusion_model_weights(model_config)
        high = super().diffusion_model_weights(model_config.model_copy(update={"expert": "high"}))
        low = super().diffusion_model_weights(self.low_expert_config(model_config))
        return high + [(file, _under("transformer_2", key_map)) for file, key_map in low]

    @hookimpl
    def parameter_groups(self, model_config: WanConfig) -> dict[str, list[str]] | None:
        """``expert = "both"``: the groups ``high`` (``transformer``) and ``low`` (``transformer_2``), for their own
        learning rates (``expert_lr``, ``[optimizer] group_lr``); otherwise one group."""
        if expert_of(model_config) != "both":
            return None
        low = LOW_PREFIX.replace(".", r"\.")
        return {"high": [rf"(?!{low})"], "low": [low]}

    @hookimpl
    def group_lr_defaults(self, model_config: WanConfig) -> dict[str, float]:
        """``[model] expert_lr``."""
        return dict(model_config.expert_lr)

    @hookimpl
    def adapter_parts(self, state_dict: dict[str, torch.Tensor], model_config: WanConfig) -> dict[str, Any] | None:
        """An A14B run's LoRA says which expert it is for (:func:`expert_label`); ``expert = "both"`` saves each
        expert's in its own folder, ``high_noise/`` (``transformer``) and ``low_noise/`` (``transformer_2``, its
        keys as that transformer's own)."""
        expert = expert_of(model_config)
        if expert is None:
            return None
        if expert != "both":
            return {"": (state_dict, expert_label(model_config, expert))}
        low = {k[len(LOW_PREFIX):]: v for k, v in state_dict.items() if k.startswith(LOW_PREFIX)}
        high = {k: v for k, v in state_dict.items() if not k.startswith(LOW_PREFIX)}
        return {EXPERT_FILES[e]: (part, expert_label(model_config, e)) for e, part in (("high", high), ("low", low))}

    @hookimpl
    def export_adapter(self, state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str) -> Any:
        """As the base exports; a state holding both experts (the check before a run) is exported expert by expert,
        the high-noise one's returned (a saved run's are split first: :meth:`adapter_parts`)."""
        low = {k[len(LOW_PREFIX):]: v for k, v in state_dict.items() if k.startswith(LOW_PREFIX)}
        if low:
            super().export_adapter(low, alpha, rank, format)
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(LOW_PREFIX)}
        return super().export_adapter(state_dict, alpha, rank, format)

    # ------------------------------------------------------------------------------------------ files
    def folder_problems(self, model_config: WanConfig) -> list[str]:
        """Problems of this entry point with a folder whose components fit (empty: none)."""
        return []

    def checked_folder(self, model_config: WanConfig) -> DiffusersFolder:
        """The component table without the optional components this folder's ``model_index.json`` does not list."""
        from dataclasses import replace

        index = _folder_facts(str(model_config.path))["index"]
        table = {k: v for k, v in self.folder.components.items() if k not in OPTIONAL or present(index, k)}
        return replace(self.folder, components=table)

    @hookimpl
    def validate_model_files(self, model_config: WanConfig) -> list[str]:
        """``expert`` first, then the shared checks (:meth:`checked_folder`'s components, the trained transformer's
        weights or ``diffusion_model`` (and ``diffusion_model_2``), the components' sizes), this entry point's own and
        the training time range; no weight is read."""
        expert = expert_problem(model_config, boundary_ratio(model_config.path))
        if expert:
            return [expert]
        found = super().validate_model_files(model_config) or self.folder_problems(model_config)
        if not found and model_config.diffusion_model_2 is not None:  # the low-noise expert's file, checked alike
            found = super().validate_model_files(self.low_expert_config(model_config))
        if not found:
            try:
                model_config.time_range(expert_range(model_config))
            except ValueError as exc:
                found.append(f"{model_config.path}: {exc}")
        return found

    @hookimpl
    def export_model(self, saved_dir: Path, model_config: WanConfig, out_dir: Path, format: str) -> bool | None:
        """As the base exports; a full fine-tune of both experts as one export per expert, in
        ``<out_dir>/high_noise/`` and ``<out_dir>/low_noise/`` (:func:`diffpipe_wan.experts.export_both`)."""
        if expert_of(model_config) != "both":
            return super().export_model(saved_dir, model_config, out_dir, format)
        if format not in ("diffusers", "single_file"):
            return None
        from diffpipe_wan.experts import export_both

        one = {"high": model_config.model_copy(update={"expert": "high"}), "low": self.low_expert_config(model_config)}
        configs = {e: {**self.folder.config(model_config.path, EXPERTS[e]), **self.model_folder_config(one[e])}
                   for e in EXPERTS}  # fmt: skip
        labels = {e: expert_label(model_config, e) for e in EXPERTS}
        export_both(saved_dir, configs, labels, Path(out_dir), format, self.single_file_name)
        return True

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

        if expert_of(model_config) == "both":
            from diffpipe_wan.experts import split_both

            return split_both(model)
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

    def with_expert(self, inputs: tuple, t: torch.Tensor, model_config: WanConfig, timestep: Any = None) -> tuple:
        """``inputs`` plus, for ``expert = "both"``, each sample's expert (:func:`diffpipe_wan.experts.expert_index`
        of its time ``t``; ``timestep``: the sampling scheduler's, compared as ``WanPipeline`` compares it)."""
        if expert_of(model_config) != "both":
            return inputs
        import torch

        from diffpipe_wan.experts import HIGH, LOW, expert_index

        ratio = boundary_ratio(model_config.path)
        if timestep is None:
            return (*inputs, expert_index(t, ratio))
        scheduler, index = timestep  # WanPipeline: transformer while t >= boundary_ratio * num_train_timesteps
        high = bool(scheduler.timesteps[index] >= ratio * float(scheduler.config.num_train_timesteps))
        return (*inputs, torch.full(t.shape, HIGH if high else LOW, dtype=torch.long))

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds[, expert]), (velocity[, mask]))`` (module docstring; ``expert``: ``expert =
        "both"``, :mod:`diffpipe_wan.experts`); all randomness from ``generator``."""
        from diffpipe_core.parts.flow import with_mask

        f = self.noisy(batch, context, generator)
        inputs = self.with_expert((f.x_t, f.t, batch["text_embeds"].float()), f.t, context.model_config)
        return inputs, with_mask((f.target,), batch)

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
        shape = self.sample_shape(latent_shape(vae, self.model_folder_config(model_config), request), model_config)
        return torch.randn(shape, generator=generator), stepped_schedule(model_config.path, request.steps)

    def sample_shape(self, shape: tuple[int, ...], model_config: WanConfig) -> tuple[int, ...]:
        """The noise's shape for a sample whose video's latents are ``shape`` (``wan-vace`` adds reference frames)."""
        return shape

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds[, expert])``, ``t`` the scheduler's timestep (over 1000) as the
        pipelines give it; ``expert = "both"``: the expert ``WanPipeline`` runs at that timestep."""
        from diffpipe_core.sampling.schedules import schedule_time

        t = schedule_time(schedule, index).float().expand(latents.shape[0])
        return self.with_expert((latents.float(), t, text["text_embeds"].float()), t, model_config,
                                sampling_timestep(schedule, index))

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """``latents / (1 / latents_std) + latents_mean``, as the Wan pipelines decode."""
        from diffpipe_wan.encoding import denormalize

        return denormalize(latents, vae)


def sampling_timestep(schedule: Any, index: int) -> tuple[Any, int] | None:
    """``(scheduler, index)`` of a schedule :func:`~diffpipe_core.sampling.schedules.stepped_schedule` made (None for
    another schedule)."""
    scheduler = getattr(schedule, "diffpipe_scheduler", None)
    return (scheduler, index) if scheduler is not None else None


def _under(component: str, key_map: Any) -> Any:
    """A per-stage key map whose model tensors are named under ``component.`` (a held component's)."""

    def mapped(key: str) -> Any:
        made = key_map(key)
        if not made:
            return made
        if isinstance(made, str):
            return f"{component}.{made}"
        return [(f"{component}.{name}", fn) for name, fn in made]

    return mapped


wan = Wan()
