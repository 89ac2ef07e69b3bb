"""The ERNIE-Image model plugin (entry point ``ernie-image``) on the core's shared plugin parts. ERNIE-Image is a
single-stream DiT over ``[image, text]`` tokens with one adaLN modulation shared by every block; its text is a
caption's Ministral 3 hidden states (the penultimate layer, every token, no template), its latents FLUX.2's VAE
posterior cut into 2x2 patches and normalised by the VAE's batch-norm statistics (multiples of 16 pixels).

No torch import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.flux2_vae import vae_layout
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_ernie.config import ErnieImageConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.parts.layout import KeyTable
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "ErnieImageTransformer2DModel",
    "vae": "AutoencoderKLFlux2",
    "text_encoder": "Mistral3Model",
    "tokenizer": TOKENIZER,
}
#: the linears of a block: attention (q, k, v, out) and the gated MLP
BLOCK_LINEARS = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")
#: ErnieImagePipeline un-normalises with this batch-norm epsilon (the trained value), not the VAE config's
BN_EPS = 1e-5
#: what ComfyUI's files leave out: the batch norm's step count, Ministral 3's vision tower (the file is the language
#: model)
VAE_OPTIONAL = ("bn.num_batches_tracked",)
TEXT_OPTIONAL = ("vision_tower.", "multi_modal_projector.")
X_EMBEDDER = weight_of("x_embedder.proj")
HEAD_DIM = Shape(weight_of("layers.0.self_attention.norm_q"), 0)  # a per-head RMS norm


def patchify(z: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, 4C, H/2, W/2)``, channel ``4c + 2dy + dx``
    (``ErnieImagePipeline._patchify_latents``)."""
    from diffpipe_core.parts.latents import pack_2x2

    b, c, h, w = z.shape
    return pack_2x2(z).transpose(1, 2).reshape(b, 4 * c, h // 2, w // 2)


def unpatchify(z: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify` (``ErnieImagePipeline._unpatchify_latents``)."""
    from diffpipe_core.parts.latents import unpack_2x2

    _, _, h, w = z.shape
    return unpack_2x2(z.flatten(2).transpose(1, 2), 2 * h, 2 * w)


class ErnieImage(DiffusersModel, FlowSampling):
    """ERNIE-Image (base or Turbo): the transformer trained on cached Ministral 3 features and FLUX.2 latents; samples
    as ``ErnieImagePipeline``, with the folder's own scheduler."""
    #: the released size (baidu/ERNIE-Image, 8 B) for the GPU-fit table (diffpipe_core.engine.fit_table): ComfyUI's
    #: ErnieImageModel defaults, which are the release's (36 blocks of 4096 = 32 x 128, MLP 12288, text 3072 =
    #: Ministral 3 3B); FLUX.2's VAE (32 channels, 16x with the 2x2 patches); the caption at text_max_length's 256
    plan_size = {
        "transformer": {"hidden_size": 4096, "num_attention_heads": 32, "num_layers": 36, "ffn_hidden_size": 12288,
                        "in_channels": 128, "out_channels": 128, "patch_size": 1, "text_in_dim": 3072,
                        "rope_theta": 256, "rope_axes_dim": [32, 48, 48], "eps": 1e-6, "qk_layernorm": True},
        "vae": {"latent_channels": 32, "block_out_channels": [128, 256, 512, 512]},
        "text": {"text_embeds": (256, 3072), "text_mask": (256,)},
    }  # fmt: skip
    tiny_writer = "diffpipe_ernie.testing:write_tiny_ernie"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "ernie-image", ErnieImageConfig,
        "ERNIE-Image / ERNIE-Image Turbo (diffusers folder, or ComfyUI's single-file transformer over it)",
        encoder_settings=("text_max_length",), block_layers=("BlockLayer",), spatial_multiple=16,
    )
    folder = DiffusersFolder(
        "ernie-image",
        ("ErnieImagePipeline",),
        COMPONENTS,
        sizes=(SizeMatch("text_encoder", "text_config.hidden_size", "text_in_dim", 2560),),
        single_file_example="ernie-image.safetensors",
        title="ERNIE-Image",
        file_layouts={"vae": vae_layout},  # ComfyUI's flux2-vae.safetensors is in BFL's layout
        file_optional={"vae": VAE_OPTIONAL, "text_encoder": TEXT_OPTIONAL},
    )
    model_class = "ErnieImageTransformer2DModel"
    sample_pipeline = "ErnieImagePipeline"
    comfy_takes_diffusers_names = True  # ComfyUI's ErnieImage model has diffusers' module names
    single_file_markers = ("layers.0.adaLN_sa_ln.weight", "x_embedder.proj.weight")
    single_file_name = "ernie_image_transformer.safetensors"
    file_config = {  # block count and widths from the file itself
        "num_layers": blocks("layers"),
        "hidden_size": Shape(X_EMBEDDER, 0),
        "in_channels": Shape(X_EMBEDDER, 1),
        "out_channels": Shape(weight_of("final_linear"), 0),
        "num_attention_heads": Shape(X_EMBEDDER, 0, per=HEAD_DIM),
        "ffn_hidden_size": Shape(weight_of("layers.0.mlp.gate_proj"), 0),
        "text_in_dim": Shape(weight_of("text_proj"), 1),
    }

    def original_layout(self, transformer_config: dict[str, Any]) -> KeyTable:
        """ComfyUI's layout: diffusers' names (optionally under ``model.diffusion_model.``)."""
        from diffpipe_core.parts.layout import KeyTable

        return KeyTable((), name="ComfyUI", model="ERNIE-Image transformer", passthrough=True)

    def lora_layout(self, state_dict: dict[str, torch.Tensor]) -> KeyTable:
        return self.original_layout({})

    def default_lora_targets(self, model_config: ErnieImageConfig) -> list[str]:
        """Every block's attention and MLP linears (the shared ``adaLN_modulation`` and the embedders are left
        alone, as diffusion-pipe leaves them)."""
        return list(BLOCK_LINEARS)

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: ErnieImageConfig, device: torch.device) -> Any:
        """The VAE, and Ministral 3 with its tokenizer in an ``ErnieImagePipeline`` holding only them, so the
        tokens and the hidden layer (the penultimate) are the pipeline's own."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.text = text_pipeline("ErnieImagePipeline", text_encoder=enc.text_encoder, tokenizer=enc.tokenizer)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 4C, H/16, W/16): the VAE posterior's mode in 2x2 patches, normalised by ``vae.bn``'s
        statistics as the pipeline un-normalises them; ``mask`` on that grid. Captions: ``text_embeds`` (B,
        text_max_length, d) and ``text_mask``: each caption's ``ErnieImagePipeline.encode_prompt`` tokens first,
        zero-padded; a caption of more tokens is refused, naming it."""
        import torch

        from diffpipe_core.parts.latents import latent_mask, vae_mode
        from diffpipe_core.parts.text import fixed_length

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = self.normalized(encoders.vae, vae_mode(encoders.vae, batch.pixels))
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        if batch.captions is not None:
            length = encoders.config.text_max_length
            with torch.no_grad():
                embeds = encoders.text.encode_prompt(list(batch.captions), device=encoders.device)
            for caption, e in zip(batch.captions, embeds, strict=True):
                if len(e) > length:
                    shown = caption if len(caption) <= 80 else caption[:77] + "..."
                    raise ValueError(f"caption {shown!r} is {len(e)} Ministral 3 tokens, over [model] text_max_length "
                                     f"= {length}; raise it or shorten the caption")
            padded = [fixed_length(e[None].float(), torch.ones(1, len(e), dtype=torch.bool), length) for e in embeds]
            out["text_embeds"] = torch.cat([e for e, _ in padded]).cpu()
            out["text_mask"] = torch.cat([m for _, m in padded]).long().cpu()
        return out

    @staticmethod
    def normalized(vae: Any, z: torch.Tensor) -> torch.Tensor:
        """Posterior latents ``(B, C, H, W)`` as the transformer sees them: patchified and batch-norm normalised."""
        from diffpipe_core.parts.flux2_vae import bn_stats
        from diffpipe_core.parts.latents import normalize

        return normalize(patchify(z.float().cpu()), *bn_stats(vae, BN_EPS))

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """Inverse of :meth:`normalized`: the latents the VAE decodes (``z * bn_std + bn_mean``, unpatchified)."""
        from diffpipe_core.parts.flux2_vae import bn_stats
        from diffpipe_core.parts.latents import denormalize

        return unpatchify(denormalize(latents.float().cpu(), *bn_stats(vae, BN_EPS)))

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: ErnieImageConfig) -> list[nn.Module]:
        """The embedders, each block, the final layer."""
        from diffpipe_ernie import layers

        return layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text, text_mask), (velocity[, mask]))`` on the patchified latents; rectified flow with the
        run's time sampling and ``shift``. The text is cut to the micro-batch's longest caption."""
        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_core.parts.text import trimmed

        f = flow_sample(batch["latents"], context.model_config, context, generator)
        text, mask = trimmed(batch["text_embeds"], batch["text_mask"])
        return (f.x_t, f.t, text.float(), mask), with_mask((f.target,), batch)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: ErnieImageConfig, generator: torch.Generator):
        """Noise ``(1, in_channels, H/16, W/16)`` as the pipeline draws it, and the sigmas its scheduler (the folder's
        own) makes of ``linspace(1, 0, steps + 1)[:-1]``."""
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        folder = self.model_folder(model_config)
        factor = 2 ** len(self.folder.config(folder, "vae")["block_out_channels"])
        channels = int(self.model_folder_config(model_config)["in_channels"])
        h, w = request.height // factor, request.width // factor
        base = torch.linspace(1.0, 0.0, request.steps + 1)[:-1]
        return torch.randn((1, channels, h, w), generator=generator), scheduler_flow_sigmas(folder, base.tolist())

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, sigma, text, text_mask)`` at ``schedule[index]``."""
        from diffpipe_core.parts.text import trimmed

        embeds, mask = trimmed(text["text_embeds"], text["text_mask"])
        return latents.float(), schedule[index].float().expand(latents.shape[0]), embeds.float(), mask


plugin = ErnieImage()
