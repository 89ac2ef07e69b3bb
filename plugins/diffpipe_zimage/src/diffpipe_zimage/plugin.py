"""The Z-Image model plugin (entry point ``z-image``): Z-Image and Z-Image Turbo on the core's shared plugin parts.

No torch import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_zimage.config import ZImageConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

#: the linears of every block (noise refiner, context refiner, main), matched as name suffixes
BLOCK_LINEARS = (
    *("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"),
    *("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
)
COMPONENTS = {
    "transformer": "ZImageTransformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": ("Qwen3Model", "Qwen3ForCausalLM"),
    "tokenizer": TOKENIZER,
}

X_EMBEDDER = weight_of("x_embedder", "all_x_embedder.2-1")
HEAD_DIM = Shape(weight_of("layers.0.attention.q_norm", "layers.0.attention.norm_q"), 0)  # a per-head RMS norm


class ZImage(DiffusersModel, FlowSampling):
    """Z-Image: a single-stream image DiT on Qwen3 text features; VAE factor 8 x 2x2 patches = multiples of 16
    pixels."""
    #: the released size (Z-Image-Turbo, 6.2 B) for the GPU-fit table (diffpipe_core.engine.fit_table):
    #: Tongyi-MAI/Z-Image-Turbo's transformer/config.json; FLUX.1's VAE; Qwen3-4B (2560) at text_max_length's
    #: default 512
    plan_size = {
        "transformer": {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
                        "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-05, "qk_norm": True,
                        "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
                        "axes_lens": [1536, 512, 512]},
        "vae": {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512]},
        "text": {"text_embeds": (512, 2560), "text_mask": (512,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_zimage.testing:write_tiny_zimage"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "z-image", ZImageConfig, "Z-Image / Z-Image Turbo (diffusers folder or original single-file transformer)",
        encoder_settings=("text_max_length",), block_layers=("NoiseRefinerLayer", "ContextRefinerLayer", "MainLayer"),
    )
    folder = DiffusersFolder(
        "z-image",
        ("ZImagePipeline", "ZImageImg2ImgPipeline"),
        COMPONENTS,
        sizes=(SizeMatch("text_encoder", "hidden_size", "cap_feat_dim", 2560),),
        single_file_example="z_image_turbo_bf16.safetensors",
    )
    model_class = "ZImageTransformer2DModel"
    comfy_takes_diffusers_names = True  # ComfyUI's Lumina2/Z-Image key map: diffusers names, fused by ComfyUI
    # adaLN_modulation.0: no SiLU before the linear (Lumina 2, of the same family, has adaLN_modulation.1)
    single_file_markers = ("layers.0.attention.qkv.weight", "layers.0.adaLN_modulation.0.weight")
    single_file_name = "z_image_transformer.safetensors"
    file_config = {  # block counts and widths from the file itself (the original or diffusers' names)
        "n_layers": blocks("layers"),
        "n_refiner_layers": blocks("noise_refiner"),
        "dim": Shape(X_EMBEDDER, 0),
        "n_heads": Shape(X_EMBEDDER, 0, per=HEAD_DIM),
        "n_kv_heads": Shape(X_EMBEDDER, 0, per=HEAD_DIM),  # Z-Image's releases have as many key/value heads as heads
        "cap_feat_dim": Shape(weight_of("cap_embedder.1"), 1),
    }
    key_tables = "diffpipe_zimage.original"  # its layout_for_config / lora_layout: the original single-file layout

    def default_lora_targets(self, model_config: ZImageConfig) -> list[str]:
        """Attention and feed-forward linears of every block, and the adaLN linear of the modulated ones (noise
        refiner and main blocks), by full name: the final layer's ``adaLN_modulation.0`` is its SiLU."""
        config = self.model_folder_config(model_config)
        n_refiner, n_layers = int(config.get("n_refiner_layers", 2)), int(config.get("n_layers", 30))
        modulated = [f"noise_refiner.{i}" for i in range(n_refiner)] + [f"layers.{i}" for i in range(n_layers)]
        return list(BLOCK_LINEARS) + [f"{block}.adaLN_modulation.0" for block in modulated]

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: ZImageConfig, device: torch.device) -> Any:
        """The VAE, and Qwen3 with its tokenizer in a ``ZImagePipeline`` holding only them, so the chat template,
        the hidden layer (the penultimate) and the mask are the pipeline's own."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.text = text_pipeline("ZImagePipeline", text_encoder=enc.text_encoder, tokenizer=enc.tokenizer)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, H/8, W/8) as ``(mode - shift_factor) * scaling_factor``, ``mask`` on the latent
        grid. Captions: ``text_embeds`` (B, text_max_length, d) and ``text_mask`` (B, text_max_length): each
        caption's ``ZImagePipeline.encode_prompt`` tokens first, zero-padded."""
        import torch

        from diffpipe_core.parts.latents import latent_mask, shift_and_scale, vae_mode
        from diffpipe_core.parts.text import fixed_length

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = shift_and_scale(vae_mode(encoders.vae, batch.pixels), encoders.vae.config).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        if batch.captions is not None:
            length = encoders.config.text_max_length
            with torch.no_grad():
                embeds, _ = encoders.text.encode_prompt(
                    list(batch.captions),  # encode_prompt rewrites its list in place
                    device=encoders.device,
                    do_classifier_free_guidance=False,
                    max_sequence_length=length,
                )
            padded = [fixed_length(e[None].float(), torch.ones(1, len(e), dtype=torch.bool), length) for e in embeds]
            out["text_embeds"] = torch.cat([e for e, _ in padded]).cpu()
            out["text_mask"] = torch.cat([m for _, m in padded]).long().cpu()
        return out

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: ZImageConfig) -> list[nn.Module]:
        """Embedders, each noise-refiner, context-refiner and main block, the final layer."""
        from diffpipe_zimage import layers

        return layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text_embeds, text_mask), (target[, mask]))`` on the latents ``(B, C, h, w)``; rectified flow
        (:func:`diffpipe_core.parts.flow.flow_sample`) with ``shift``."""
        from diffpipe_core.parts.flow import flow_sample, with_mask

        f = flow_sample(batch["latents"], context.model_config, context, generator)
        inputs = (f.x_t, f.t, batch["text_embeds"].float(), batch["text_mask"].long())
        return inputs, with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: ZImageConfig, generator: torch.Generator):
        """Noise ``(1, C, H/8, W/8)`` and the folder's scheduler sigmas of ``linspace(1, 1/steps, steps)``, as
        ``ZImagePipeline`` makes them."""
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        vae = self.folder.config(model_config.path, "vae")
        factor = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
        channels = int(self.model_folder_config(model_config).get("in_channels", 16))
        h, w = 2 * (request.height // (factor * 2)), 2 * (request.width // (factor * 2))
        base = torch.linspace(1.0, 1 / request.steps, request.steps).tolist()
        schedule = scheduler_flow_sigmas(model_config.path, base, image_seq_len=(h // 2) * (w // 2))
        return torch.randn((1, channels, h, w), generator=generator), schedule

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, t, text_embeds, text_mask)``."""
        t = schedule[index].float().expand(latents.shape[0])
        return latents.float(), t, text["text_embeds"].float(), text["text_mask"].long()


plugin = ZImage()
