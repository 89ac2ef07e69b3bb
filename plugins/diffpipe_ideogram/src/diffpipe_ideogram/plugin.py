"""The Ideogram 4 model plugin (entry point ``ideogram4``) on the core's shared plugin parts. Ideogram 4 is a
single-stream transformer over ``[text, image]``: a caption's Qwen3-VL hidden states tapped at 13 layers
(concatenated per token), and FLUX.2's VAE latents cut into 2x2 patches and normalised by the VAE's batch-norm
statistics (multiples of 16 pixels). Its pipeline guides with a second, unconditional transformer; this plugin trains
the conditional one (``transformer``), as diffusion-pipe does, and samples at ``cfg > 1`` through both. No torch
import at the top (``diffpipe --help``, ``models``, ``validate`` load every plugin): hooks import it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.flux2_vae import vae_layout
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling
from diffpipe_ideogram.config import Ideogram4Config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

COMPONENTS = {
    "transformer": "Ideogram4Transformer2DModel",
    "vae": "AutoencoderKLFlux2",
    "text_encoder": "Qwen3VLModel",
    "tokenizer": TOKENIZER,
}
#: the linears of a block (the anchor's LoRA targets: every linear of ``Ideogram4TransformerBlock``)
BLOCK_LINEARS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3", "adaln_modulation")
#: Ideogram4Pipeline's defaults: the logit-normal schedule's base mean and spread
SCHEDULE_MU, SCHEDULE_STD = 0.0, 1.5
#: the token-role indicator of a caption token (``LLM_TOKEN_INDICATOR``)
TEXT_TOKEN = 3


def patchify(z: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, 4C, H/2, W/2)``, channel ``(2 dy + dx) * C + c``: the pipeline's token channels
    (it unpatchifies ``(gh, gw, dy, dx, c)``)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4).reshape(b, 4 * c, h // 2, w // 2)


def unpatchify(z: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify`."""
    b, c4, h, w = z.shape
    c = c4 // 4
    return z.view(b, 2, 2, c, h, w).permute(0, 3, 4, 1, 5, 2).reshape(b, c, 2 * h, 2 * w)


def tokens(z: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, h*w, C)`` row by row: the pipeline's packed latents."""
    return z.flatten(2).transpose(1, 2)


def untokens(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`tokens` for an ``h x w`` grid."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)


class Ideogram4(DiffusersModel, FlowSampling):
    """Ideogram 4: the conditional transformer over ``[text, image]``; samples as ``Ideogram4Pipeline``, its
    unconditional transformer (declared ``unconditional_model``) running the negative branch when ``cfg > 1``."""
    #: the released size (Ideogram 4, ideogram-ai/ideogram-v4: the 9 B conditional transformer) for the GPU-fit table
    #: (diffpipe_core.engine.fit_table): diffusers 0.42.1's Ideogram4Transformer2DModel defaults, which are the
    #: release's transformer config (34 blocks of 18 x 256, SwiGLU 12288; llm_features_dim 53248 = the pipeline's 13
    #: tapped Qwen3-VL-8B layers x 4096); FLUX.2's VAE (32 channels, 16x with the 2x2 patches); the caption at
    #: text_max_length's default 256
    plan_size = {
        "transformer": {"in_channels": 128, "num_layers": 34, "attention_head_dim": 256, "num_attention_heads": 18,
                        "intermediate_size": 12288, "adaln_dim": 512, "llm_features_dim": 53248,
                        "rope_theta": 5000000, "mrope_section": [24, 20, 20], "norm_eps": 1e-5},
        "vae": {"latent_channels": 32, "block_out_channels": [128, 256, 512, 512]},
        "text": {"text_embeds": (256, 53248), "text_mask": (256,)},
    }  # fmt: skip

    tiny_writer = "diffpipe_ideogram.testing:write_tiny_ideogram4"  # python -m diffpipe_core.testing.tiny_models
    spec = diffusers_spec(
        "ideogram4", Ideogram4Config,
        "Ideogram 4 text-to-image (diffusers folder, or ComfyUI's single-file transformer over it)",
        contract=4, encoder_settings=("text_max_length",), block_layers=("BlockLayer",), spatial_multiple=16,
        unconditional_model="unconditional_transformer",  # the pipeline's guidance runs it (cfg > 1 samples)
    )
    folder = DiffusersFolder(
        "ideogram4",
        ("Ideogram4Pipeline",),
        COMPONENTS,
        single_file_example="ideogram4_fp8_scaled.safetensors",
        title="Ideogram 4",
        file_layouts={"vae": vae_layout},  # ComfyUI's flux2-vae.safetensors is in BFL's layout
        file_optional={"text_encoder": ("visual.",)},  # text encoding never runs the vision tower
    )
    model_class = "Ideogram4Transformer2DModel"
    key_tables = "diffpipe_ideogram.original"
    single_file_markers = ("llm_cond_proj.weight", "embed_image_indicator.weight")
    single_file_name = "ideogram4_transformer.safetensors"
    file_config = {"num_layers": r"(?:^|\.)layers\.(\d+)\."}
    lora_target_names = BLOCK_LINEARS
    # no sample_pipeline for the kit: Ideogram4Pipeline takes packed latents and guides with its second transformer;
    # tests/test_ideogram4_sampling.py compares the samples with it at guidance 1 and above

    def default_lora_targets(self, model_config: Ideogram4Config) -> list[str]:
        """Every block's linears by full name (``final_layer.adaln_modulation`` is not a block's)."""
        count = int(self.model_folder_config(model_config)["num_layers"])
        return [f"layers.{i}.{name}" for i in range(count) for name in BLOCK_LINEARS]

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: Ideogram4Config, device: torch.device) -> Any:
        """The VAE, and Qwen3-VL with its tokenizer in a text-only ``Ideogram4Pipeline`` (its chat template, its left
        padding, its 13 tapped layers)."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.text = text_pipeline("Ideogram4Pipeline", text_encoder=enc.text_encoder, tokenizer=enc.tokenizer)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, 4C, H/16, W/16): the VAE posterior's mode cut into 2x2 patches in the pipeline's
        channel order and normalised by ``vae.bn``'s statistics, as the pipeline denormalises before decoding;
        ``mask`` on that grid. Captions: ``text_embeds`` (B, text_max_length, 13 d) and ``text_mask``: the pipeline's
        ``encode_prompt`` at ``max_sequence_length = text_max_length`` with each caption's tokens moved to the front
        (the pipeline pads on the left, each padding token a segment of its own), bfloat16 when the encoder runs in
        it."""
        import torch

        from diffpipe_core.parts.text import compacted

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            from diffpipe_core.parts.latents import latent_mask, vae_mode

            out["latents"] = self.normalized(encoders.vae, vae_mode(encoders.vae, batch.pixels)).cpu()
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape)
        if batch.captions is not None:
            length = encoders.config.text_max_length
            self.check_lengths(encoders.tokenizer, list(batch.captions), length)
            with torch.no_grad():
                embeds, _, _, indicator = encoders.text.encode_prompt(
                    list(batch.captions), grid_h=1, grid_w=1, max_sequence_length=length, device=encoders.device
                )
            embeds, mask = compacted(embeds[:, :length].cpu(), indicator[:, :length].cpu() == TEXT_TOKEN)
            dtype = torch.bfloat16 if encoders.text_encoder.dtype == torch.bfloat16 else torch.float32
            out.update(text_embeds=embeds.to(dtype), text_mask=mask.long())
        return out

    @staticmethod
    def check_lengths(tokenizer: Any, captions: list[str], length: int) -> None:
        """A clear error for a caption whose chat-formatted tokens exceed ``text_max_length`` (the pipeline refuses
        such a prompt too), naming the caption and its count."""
        for caption in captions:
            messages = [{"role": "user", "content": [{"type": "text", "text": caption}]}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if n > length:
                shown = caption if len(caption) <= 80 else caption[:77] + "..."
                raise ValueError(
                    f"caption {shown!r} is {n} Qwen3-VL tokens with Ideogram 4's chat template, over [model] "
                    f"text_max_length = {length}; raise it (at most 2048) or shorten the caption"
                )

    @staticmethod
    def normalized(vae: Any, z: torch.Tensor) -> torch.Tensor:
        """Posterior latents ``(B, C, H, W)`` as the transformer's tokens see them: patchified, normalised by the
        VAE's batch-norm statistics (in the pipeline's channel order)."""
        from diffpipe_core.parts.flux2_vae import bn_stats
        from diffpipe_core.parts.latents import normalize

        return normalize(patchify(z.float().cpu()), *bn_stats(vae))

    def denormalize(self, latents: torch.Tensor, vae: Any) -> torch.Tensor:
        """Inverse of :meth:`normalized`: the latents the VAE decodes (``z * bn_std + bn_mean``, unpatchified)."""
        from diffpipe_core.parts.flux2_vae import bn_stats
        from diffpipe_core.parts.latents import denormalize

        return unpatchify(denormalize(latents.float().cpu(), *bn_stats(vae)))

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: Ideogram4Config) -> list[nn.Module]:
        """Embedders (+ the MRoPE table, computed once), each block, the final layer."""
        from diffpipe_ideogram import layers

        return layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x_t, t, text, text_mask, grid), (velocity[, mask]))`` as the pipeline's tokens; rectified flow with the
        run's time sampling and ``shift``. The text is cut to the micro-batch's longest caption (the rest is
        padding)."""
        import torch

        from diffpipe_core.parts.flow import flow_sample, with_mask
        from diffpipe_core.parts.text import trimmed

        cfg: Ideogram4Config = context.model_config  # type: ignore[assignment]
        b, c, h, w = batch["latents"].shape
        f = flow_sample(batch["latents"], cfg, context, generator)
        text, mask = trimmed(batch["text_embeds"], batch["text_mask"])
        targets = with_mask((tokens(f.target),), batch, lambda m: tokens(m.expand(b, c, h, w).contiguous()))
        return (tokens(f.x_t), f.t, text, mask, torch.tensor([h, w])), targets

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: Ideogram4Config, generator: torch.Generator):
        """Noise drawn as the pipeline's ``prepare_latents`` draws its tokens ``(1, N, 4C)``, laid out ``(1, 4C,
        H/16, W/16)``; the sigmas its scheduler makes of the resolution-aware logit-normal schedule (the pipeline's
        default ``mu`` and ``std``)."""
        import torch
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas

        vae = self.folder.config(self.model_folder(model_config), "vae")
        factor = 2 ** (len(vae["block_out_channels"]) - 1) * 2
        channels = int(self.model_folder_config(model_config)["in_channels"])
        h, w = request.height // factor, request.width // factor
        noise = untokens(torch.randn((1, h * w, channels), generator=generator), h, w)
        mu = _resolution_aware_mu(height=request.height, width=request.width, base_mu=SCHEDULE_MU)
        sigmas = _logit_normal_sigmas(request.steps, mu, std=SCHEDULE_STD)
        return noise, scheduler_flow_sigmas(self.model_folder(model_config), sigmas.tolist())

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's ``(x_t, sigma, text, text_mask, grid)`` at ``schedule[index]``."""
        import torch

        from diffpipe_core.parts.text import trimmed

        b, _, h, w = latents.shape
        # the pipeline's scheduler timestep (sigma * 1000, float32) divided by 1000
        sigma = (schedule[index].float() * 1000 / 1000).expand(b)
        embeds, mask = trimmed(text["text_embeds"], text["text_mask"])
        return tokens(latents.float()), sigma, embeds, mask, torch.tensor([h, w])

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return untokens(prediction, latents.shape[-2], latents.shape[-1])

    @hookimpl
    def unconditional_inputs(self, latents, schedule, index, request, model_config):
        """The unconditional transformer's first-layer inputs: the image tokens alone, with no text (the pipeline's
        unconditional branch: zeroed text features, the image region of its layout), at ``schedule[index]``."""
        import torch

        width = int(self.model_folder_config(model_config)["llm_features_dim"])
        empty = {"text_embeds": torch.zeros(1, 0, width), "text_mask": torch.zeros(1, 0, dtype=torch.long)}
        return self.denoise_inputs(latents, schedule, index, empty, request, model_config)


plugin = Ideogram4()
