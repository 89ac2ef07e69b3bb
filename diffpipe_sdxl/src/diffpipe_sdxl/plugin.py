"""The SDXL model plugin (entry point ``sdxl``) on the core's shared plugin parts: the UNet from a diffusers folder or
from an SGM single file that holds the UNet, both CLIPs and the VAE; DDPM training (epsilon or v-prediction); LoRAs in
the diffusers and kohya layouts.

This module imports no torch, diffusers or transformers (``diffpipe --help``, ``models`` and ``validate`` load every
plugin); each hook imports what does the work when it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import DiffusersModel
from diffpipe_core.parts.sampling import DDPMSampling
from diffpipe_sdxl.config import SDXLConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.parts.layout import KeyTable
    from diffpipe_core.types import SampleRequest

#: attention and feed-forward linears of the UNet's transformer blocks
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
#: each text-encoder layer's attention and MLP linears (kohya's, and ComfyUI's ``LORA_CLIP_MAP``)
TEXT_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
TEXT_GROUPS = {"text_encoder_1": [r"text_encoder\."], "text_encoder_2": [r"text_encoder_2\."]}  # parameter name regexes
KOHYA_PREFIXES = {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}
# SSD-1B and Segmind Vega ship as StableDiffusionXLPipeline folders too.
PIPELINES = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline")
COMPONENTS = {"unet": "UNet2DConditionModel", "vae": "AutoencoderKL", "text_encoder": "CLIPTextModel"}
COMPONENTS.update(text_encoder_2="CLIPTextModelWithProjection", tokenizer=TOKENIZER, tokenizer_2=TOKENIZER)


ENCODER_SETTINGS = ("path", "config_path", "vae_path", "vae_dtype", "text_encoder_dtype", "max_prompt_chunks")


class SDXL(DiffusersModel, DDPMSampling):
    """SDXL: images, VAE factor 8, sizes rounded to multiples of 64 (SDXL's bucket grid)."""
    #: the released size (SDXL 1.0 base UNet, 2.6 B) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: stabilityai/stable-diffusion-xl-base-1.0's unet/config.json; its VAE (4 channels, 8x); CLIP-L + bigG (768 + 1280
    #: wide) over three 77-token chunks, and bigG's pooled 1280
    plan_size = {
        "unet": {"in_channels": 4, "out_channels": 4, "sample_size": 128, "block_out_channels": [320, 640, 1280],
                 "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                 "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                 "transformer_layers_per_block": [1, 2, 10], "attention_head_dim": [5, 10, 20], "layers_per_block": 2,
                 "cross_attention_dim": 2048, "use_linear_projection": True, "addition_embed_type": "text_time",
                 "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2816, "norm_num_groups": 32},
        "vae": {"latent_channels": 4, "block_out_channels": [128, 256, 512, 512], "scaling_factor": 0.13025},
        "text": {"text_embeds": (231, 2048), "text_mask": (231,), "pooled": (1280,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_sdxl.testing:write_tiny_sdxl"  # python -m diffpipe_core.testing.tiny_models

    spec = ModelSpec(
        "sdxl", "image", SDXLConfig, spatial_multiple=64, encoder_settings=(*ENCODER_SETTINGS, "train_text_encoders"),
        block_layers=("UnitLayer",), adapter_formats=("diffusers", "kohya"), model_formats=("diffusers", "single_file"),
        description="Stable Diffusion XL (diffusers folder or single-file checkpoint); LoRA and full fine-tuning",
    )
    folder = DiffusersFolder(
        "sdxl", PIPELINES, COMPONENTS, model="unet", single_file_example="sd_xl_base_1.0.safetensors", title="SDXL",
        model_title="UNet", single_file_hint="or set path to an SGM single-file checkpoint (with config_path)"
    )
    model_class = "UNet2DConditionModel"
    key_tables = "diffpipe_sdxl.sgm"
    single_file_markers = ("model.diffusion_model.input_blocks.0.0.weight",)
    single_file_name = "sdxl.safetensors"
    lora_target_names = tuple(LORA_TARGETS)

    def single_file(self, model_config: SDXLConfig) -> Path | None:
        """``path`` when it is a file (the SGM checkpoint)."""
        return model_config.path if model_config.path.is_file() else None

    def model_folder(self, model_config: SDXLConfig) -> Path:
        """``config_path`` with a single file, else ``path``."""
        return model_config.config_path if model_config.path.is_file() else model_config.path  # type: ignore[return-value]

    def component_layout(self, model_config: SDXLConfig, component: str) -> KeyTable | None:
        from diffpipe_sdxl.sgm import component_tables

        return component_tables(lambda name: self.folder.config(self.model_folder(model_config), name)).get(component)

    def held_components(self, model_config: SDXLConfig) -> tuple[str, ...]:
        """Both text encoders with ``train_text_encoders``: they run in the first pipeline stage."""
        return TEXT_ENCODERS if model_config.train_text_encoders else ()

    def default_lora_targets(self, model_config: SDXLConfig) -> list[str]:
        """The UNet's transformer linears; with ``train_text_encoders`` also the text encoders' layers' (kohya's set),
        but for ``text_encoder``'s last: SDXL reads its penultimate hidden state, so that layer reaches nothing."""
        if not model_config.train_text_encoders:
            return list(LORA_TARGETS)
        n = [self.folder.config(self.model_folder(model_config), c)["num_hidden_layers"] for c in TEXT_ENCODERS]
        layers = [f"text_encoder.encoder.layers.{i}" for i in range(n[0] - 1)]  # transformers 5's module names
        layers += [f"text_encoder_2.text_model.encoder.layers.{i}" for i in range(n[1])]
        return LORA_TARGETS + [f"{layer}.{m}" for layer in layers for m in TEXT_LINEARS]

    def load_vae(self, model_config: SDXLConfig, device: torch.device) -> Any:
        """The VAE in ``vae_dtype``: ``vae_path``, else the single file's or the folder's."""
        from diffpipe_core.parts.encoders import torch_dtype

        dtype = torch_dtype(model_config.vae_dtype)
        if model_config.vae_path is None:
            return self.load_component(model_config, "vae", dtype, device)
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(str(model_config.vae_path), dtype=dtype, local_files_only=True)
        return vae.to(device).eval().requires_grad_(False)

    @hookimpl
    def validate_model_files(self, model_config: SDXLConfig) -> list[str]:
        """The folder (or the single file's UNet keys and ``config_path``) and ``vae_path``, without reading weights."""
        from diffpipe_core.model_files import check_component

        found = super().validate_model_files(model_config)
        if model_config.vae_path is not None:
            found += check_component(Path(model_config.vae_path), ("AutoencoderKL",), "VAE (vae_path)")
        return found

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: SDXLConfig, device: torch.device) -> Any:
        """The VAE, both CLIP text encoders and their tokenizers (from the folder, the single file or ``vae_path``)."""
        from diffpipe_core.parts.encoders import Encoders, torch_dtype

        cfg, folder = model_config, self.model_folder(model_config)
        parts = {name: self.folder.load(folder, name) for name in ("tokenizer", "tokenizer_2")}
        dtype = torch_dtype(cfg.text_encoder_dtype)
        for name in () if cfg.train_text_encoders else TEXT_ENCODERS:  # trained ones run in the pipeline
            parts[name] = self.load_component(cfg, name, dtype, device)
        return Encoders(cfg, device, vae=self.load_vae(cfg, device), **parts)

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents``, ``time_ids`` (and ``mask``); captions: ``text_embeds``, ``text_mask``, ``pooled``."""
        from diffpipe_sdxl.encoding import encode_batch

        return encode_batch(encoders, batch)

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def parameter_groups(self, model_config: SDXLConfig) -> dict[str, list[str]]:
        """``unet`` (everything else) and, with ``train_text_encoders``, ``text_encoder_1`` and ``text_encoder_2``, for
        ``[optimizer] group_lr`` (``validate`` refuses a group the run does not train)."""
        return {"unet": [], **(TEXT_GROUPS if model_config.train_text_encoders else {})}

    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: SDXLConfig) -> list[nn.Module]:
        """(The text encoders,) embed, one layer per resnet (with its transformer and the block's sampler), the output
        head."""
        from diffpipe_sdxl.layers import split_unet

        return split_unet(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, *text, time_ids), (target, weights[, mask]))``, text as :meth:`text_inputs`: DDPM noising at
        uniform integer timesteps, epsilon or v target, per-sample weights (``parts.ddpm.ddpm_sample``)."""
        from diffpipe_core.parts.ddpm import ddpm_sample
        from diffpipe_core.parts.flow import with_mask

        s = ddpm_sample(batch["latents"], context.model_config, context, generator)  # type: ignore[arg-type]
        inputs = (s.x_t, s.t, *self.text_inputs(batch), batch["time_ids"].float())
        return inputs, with_mask((s.target, s.weights), batch)

    def text_inputs(self, text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The first layer's text inputs from what :func:`encode_batch` cached for a caption: the embeddings, or the
        token ids when the text encoders train."""
        if "ids" in text:
            return (text["ids"].long(), text["chunks"].bool(), text["ids_2"].long(), text["chunks_2"].bool())
        return (text["text_embeds"].float(), text["text_mask"].bool(), text["pooled"].float())

    @hookimpl
    def compute_loss(self, outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Weighted, masked MSE (:func:`diffpipe_core.parts.ddpm.ddpm_loss`)."""
        from diffpipe_core.parts.ddpm import ddpm_loss

        return ddpm_loss(outputs, targets)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request: SampleRequest, model_config: SDXLConfig):
        """The scheduler-scaled latents, the step's timestep, the prompt's text tensors and ``time_ids`` of the
        requested size (original size = target size, no crop: ``StableDiffusionXLPipeline``'s defaults)."""
        import torch

        from diffpipe_core.sampling.schedules import ddpm_model_input

        b, size = latents.shape[0], [float(request.height), float(request.width)]
        t = self.ddpm_timesteps(model_config, len(schedule) - 1)[0][index].expand(b)
        time_ids = torch.tensor([size + [0.0, 0.0] + size] * b)
        return (ddpm_model_input(latents.float(), schedule, index), t, *self.text_inputs(text), time_ids)

    @hookimpl
    def load_decoder(self, model_config: SDXLConfig, device: torch.device) -> Any:
        """The VAE alone (``vae_path``, the single file's or the folder's, in ``vae_dtype``)."""
        return self.load_vae(model_config, device)

    # ------------------------------------------------------------------------------------------ exports
    @hookimpl
    def export_adapter(self, state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str) -> Any:
        """``diffusers``: ``unet.<peft key>`` (``unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q
        .lora_A.weight``; trained text encoders' under ``text_encoder.`` and ``text_encoder_2.``), alpha in the file's
        metadata (diffusers' SDXL loader rejects ``.alpha`` tensors there). ``kohya``: ``lora_unet_<SGM module>`` (e.g.
        ``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight``), ``lora_te1_`` /
        ``lora_te2_<text_model module>`` ``.lora_down/lora_up.weight``, plus ``.alpha`` (ComfyUI, A1111, diffusers)."""
        from diffpipe_core.adapters import kohya_format
        from diffpipe_core.parts.export import lora_modules, split_components

        if format != "kohya":
            return super().export_adapter(state_dict, alpha, rank, format)
        parts, out = split_components(state_dict, "unet", TEXT_ENCODERS), {}
        for part, prefix in KOHYA_PREFIXES.items():
            state = parts.get(part, {})
            out.update(kohya_format(state, alpha, prefix, rename=kohya_rename(part, lora_modules(state))))
        return out

    @hookimpl
    def adapter_key_names(self, modules: list[str], format: str) -> dict[str, str] | None:
        """LoKr/LoHa stems in ``kohya``: the kohya LoRA's module names (``lora_unet_<SGM module>``, ...)."""
        from diffpipe_core.parts.export import split_components

        if format != "kohya":
            return None
        parts, stems = split_components({m: m for m in modules}, "unet", TEXT_ENCODERS), {}
        for part, prefix in KOHYA_PREFIXES.items():
            rename = kohya_rename(part, list(parts.get(part, {})))
            stems.update({m: f"{prefix}_{rename(k).replace('.', '_')}" for k, m in parts.get(part, {}).items()})
        return stems

    @hookimpl
    def export_model(self, saved_dir: Path, model_config: SDXLConfig, out_dir: Path, format: str) -> bool | None:
        """``diffusers``: ``out_dir/unet`` (and the trained ``text_encoder``/``text_encoder_2``) as diffusers folders;
        ``single_file``: ``out_dir/sdxl.safetensors``, the trained UNet (and text encoders) with the base VAE (and text
        encoders) in the SGM layout (ComfyUI, A1111, ``from_single_file``)."""
        from diffpipe_core.atomic import atomic_save_safetensors
        from diffpipe_core.engine.saving import read_saved_model
        from diffpipe_core.parts.export import split_components

        if format not in self.spec.model_formats:
            return None
        parts = split_components(read_saved_model(saved_dir), "unet", TEXT_ENCODERS)
        folder, out_dir = self.model_folder(model_config), Path(out_dir)
        if format == "diffusers":
            for part, state in parts.items():
                (out_dir / part).mkdir(parents=True, exist_ok=True)
                (out_dir / part / "config.json").write_bytes((folder / part / "config.json").read_bytes())
                name = "diffusion_pytorch_model" if part == "unet" else "model"
                atomic_save_safetensors(state, out_dir / part / f"{name}.safetensors", {"format": "pt"})
            return True
        state = self.layout_for(model_config).to_original(parts.pop("unet"))
        for part, trained in parts.items():
            state.update(self.component_layout(model_config, part).to_original(trained))  # type: ignore[union-attr]
        base = tuple(n for n in ("vae", *TEXT_ENCODERS) if n not in parts)
        state.update(self.original_components(model_config, base))
        atomic_save_safetensors(state, out_dir / self.single_file_name, {"format": "pt"})
        return True


def kohya_rename(part: str, modules: list[str]) -> Callable[[str], str]:
    """kohya's module path of ``part``'s adapted ``modules``: the SGM UNet's, or a CLIP's under ``text_model.``
    (transformers 5's ``CLIPTextModel`` drops that level)."""
    if part == "unet":
        from diffpipe_sdxl.sgm import lora_unet_table

        return lora_unet_table(modules).original_key
    return lambda module: module if module.startswith("text_model.") else "text_model." + module


plugin = SDXL()
