"""The MiniMax H3 model plugin (entry point ``minimax-h3``) on the core's shared plugin parts.

MiniMax H3 generates video with sound: one stack of blocks over one packed sequence ``[text | audio | video]``
(:mod:`diffpipe_minimax.packing`, :mod:`diffpipe_minimax.layers`), the text a caption's Qwen3-VL hidden state after
layer 50 (the prompt verbatim), the video latents 16x spatial (17 frames to 5 latent frames) in 2x2 patches, the audio
stereo latents of its 32 kHz audio VAE at 40 per second. Its transformer predicts the data-ward velocity
``x0 - noise`` at time ``t = 1 - sigma``, the video and the audio at their own noise levels (the pipeline's shifts 12
and 3 of one base level). It is guidance-distilled: train it with ``[model] cfg`` (the core's CFG-augmented training)
to keep the distilled guidance. With ``[model] train_audio`` the clips' sound trains the audio stream through the
core's audio data path. This module imports no torch, diffusers or transformers: hooks import what they need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_minimax.config import MiniMaxH3Config
from diffpipe_minimax.vae_original import audio_vae_table, video_vae_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import AudioSpec, EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

PIPELINES = ("MiniMaxH3ModularPipeline",)
COMPONENTS = {
    "transformer": "MiniMaxH3Transformer3DModel",
    "vae": "AutoencoderKLMiniMaxH3",
    "audio_vae": "AutoencoderKLMiniMaxH3Audio",
    "text_encoder": "Qwen3VLForConditionalGeneration",
    "tokenizer": TOKENIZER,
}
#: the pipeline conditions on the text encoder's hidden state after this many layers (``text_encoder_layer``)
TEXT_LAYER = 50
#: Qwen3-VL tensors text encoding never reads (the hidden state after layer 50 is the text; ComfyUI's file is cut there
#: and has no head): a component file may leave them out
QWEN3VL_UNUSED = ("lm_head.", "model.language_model.norm.",
                  *(f"model.language_model.layers.{i}." for i in range(TEXT_LAYER, 128)))
#: the linears of the blocks and of the text refiner's blocks: attention and the SwiGLU MLP. The per-block AdaLN
#: projections (``adaln_proj``), the output modulation and the embedders stay out, as the anchor leaves them out, so a
#: LoRA fits the full checkpoint and the pruned one (whose AdaLN projections differ in size)
BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
PROJ_IN = weight_of("proj_in")
HEAD_DIM = Shape(weight_of("transformer_blocks.0.attn.norm_q"), 0)
#: the config key a pruned file's ``adaln_t_table`` sets: its rows (the curve form, diffpipe_minimax.pruned)
GRID_KEY = "adaln_curve_grid"


class MiniMaxH3(DiffusersModel):
    """MiniMax H3 text-to-video-and-audio: video (images as one frame) at 24 fps, 17k + 5 frames, sizes in multiples
    of 32 pixels; with ``train_audio`` the clips' stereo sound."""

    #: the released size (MiniMaxAI/MiniMax-H3; 33 B parameters as built) for the GPU-fit table
    #: (diffpipe_core.engine.fit_table): diffusers 0.42.1's MiniMaxH3Transformer3DModel defaults, which its
    #: docstring gives as the release's (50 blocks of 5376, 56 heads of 128, SwiGLU 14336, 2 refiner blocks, text
    #: 5120 = Qwen3-VL's hidden state); the video VAE's 24 channels at 16x, the audio VAE's 32 at 40 per second; a
    #: caption at text_max_length's 512 tokens
    plan_size = {
        "transformer": {"num_attention_heads": 56, "attention_head_dim": 128, "hidden_size": 5376, "num_layers": 50,
                        "num_refiner_layers": 2, "ffn_dim": 14336, "in_channels": 24, "audio_in_channels": 32,
                        "patch_size": [1, 2, 2], "text_dim": 5120, "freq_dim": 256, "time_embed_hidden_dim": 5376,
                        "time_embed_dim": 2688, "rope_freq_dim": 16},
        "vae": {"latent_channels": 24, "spatial_downsample_factors": [2, 2, 2, 2, 1, 1]},
        "audio_vae": {"latent_channels": 32, "sampling_rate": 32000},
        "text": {"text_embeds": (512, 5120), "text_mask": (512,)},
    }  # fmt: skip
    #: 5-second clips (124 frames: the pipeline's shortest) at 512 x 512 and at the release's 1344 x 768 canvas
    plan_resolutions = [(512, 512, 124), (1344, 768, 124)]
    tiny_writer = "diffpipe_minimax.testing:write_tiny_minimax"  # python -m diffpipe_core.testing.tiny_models

    spec = diffusers_spec(
        "minimax-h3", MiniMaxH3Config,
        "MiniMax H3 video with sound (diffusers MiniMaxH3ModularPipeline folder)",
        video=(17, 5, 24.0), spatial_multiple=32, encoder_settings=("text_max_length",),
        block_layers=("BlockLayer",), contract=4,
    )
    folder = DiffusersFolder(
        "minimax-h3", PIPELINES, COMPONENTS,
        sizes=(SizeMatch("text_encoder", "text_config.hidden_size", "text_dim", 5120),),
        single_file_example="minimax_h3_transformer.safetensors", title="MiniMax H3",
        # ComfyUI's minimax_h3_video_vae_*.safetensors (the reference layout) and audio VAE (weight norms folded)
        file_layouts={"vae": video_vae_table, "audio_vae": audio_vae_table},
        file_optional={"text_encoder": QWEN3VL_UNUSED},
    )
    model_class = "MiniMaxH3Transformer3DModel"
    single_file_markers = ("blocks.0.attn.qkv_proj.weight", "audio_patch_proj.weight")
    single_file_name = "minimax_h3_transformer.safetensors"
    file_config = {  # block count and widths from the file itself (diffusers' names)
        "num_layers": blocks("transformer_blocks"),
        "num_refiner_layers": blocks("token_refiner.refiner_blocks"),
        "hidden_size": Shape(PROJ_IN, 0),
        "num_attention_heads": Shape(weight_of("transformer_blocks.0.attn.to_q"), 0, per=HEAD_DIM),
        "ffn_dim": Shape(weight_of("transformer_blocks.0.ff.net.2"), 1),
        "text_dim": Shape(weight_of("context_embedder"), 1),
        "audio_in_channels": Shape(weight_of("audio_proj_in"), 1),
        # the pruned (curve-form) checkpoint: the table's rows, and its width as the AdaLN projections' input
        "adaln_curve_grid": Shape(r"(?:^|\.)adaln_t_table$", 0),
        "time_embed_dim": Shape(weight_of("blocks.0.adaln_proj.linear", "transformer_blocks.0.adaln_proj.linear"), 1),
    }
    lora_target_names = BLOCK_LINEARS

    def __init__(self) -> None:
        self._grids: dict[int, Any] = {}  # a sample's joined latents' size -> its geometry (sampling.Grid)
    key_tables = "diffpipe_minimax.original"  # the reference layout: ComfyUI's and the published single files'

    def build_skeleton(self, model_config: MiniMaxH3Config, device: Any, dtype: torch.dtype) -> nn.Module:
        """The transformer from its config, in the curve form of a pruned ``diffusion_model`` file (its
        ``adaln_t_table`` in place of the time MLP: :mod:`diffpipe_minimax.pruned`) when the file is one."""
        config = self.model_folder_config(model_config)
        grid = config.pop(GRID_KEY, None)
        model = self.skeleton_of(config, device, dtype)
        if grid is None:
            return model
        from diffpipe_minimax.pruned import to_curve_form

        return to_curve_form(model, int(grid), dtype)

    def patch_size(self, model_config: MiniMaxH3Config) -> tuple[int, int, int]:
        """The transformer's ``(t, h, w)`` patch."""
        return tuple(self.model_folder_config(model_config).get("patch_size", (1, 2, 2)))  # type: ignore[return-value]

    @hookimpl
    def audio_spec(self, model_config: MiniMaxH3Config) -> AudioSpec | None:
        """With ``train_audio``: stereo at the audio VAE's ``sampling_rate``; a damaged track trains without audio,
        as a clip without one does. None otherwise (no audio is read)."""
        if not model_config.train_audio:
            return None
        from diffpipe_core import AudioSpec

        audio = self.folder.config(self.model_folder(model_config), "audio_vae")
        return AudioSpec(int(audio.get("sampling_rate", 32000)), 2)

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def load_encoders(self, model_config: MiniMaxH3Config, device: torch.device) -> Any:
        """The video VAE, Qwen3-VL, its tokenizer and processor (the folder's ``processor``); with ``train_audio`` the
        audio VAE."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.vl_processors import ImageOnlyQwen3VLProcessor, load_processor

        extra = ("audio_vae",) if model_config.train_audio else ()
        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer", *extra)
        enc.processor = load_processor(self.model_folder(model_config) / "processor", ImageOnlyQwen3VLProcessor)
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, F', H/16, W/16), each item as the pipeline encodes a visual condition
        (``encode_vae_condition``: ImageNet-normalised pixels, the posterior drawn under its fixed seed, normalised by
        the VAE's ``latents_mean`` / ``latents_std``; images as one frame), ``mask`` on that grid; with sound
        ``audio_latents`` (B, 2 L, Ca) and ``audio_mask`` (:func:`diffpipe_minimax.audio.encode_audio`). Captions:
        ``text_embeds`` (B, text_max_length, d) and ``text_mask``: each caption's tokens (verbatim, no special
        tokens) through ``get_qwen3vl_prompt_embeds`` at layer 50, as ``MiniMaxH3TextEncoderStep`` runs it."""

        from diffpipe_core.parts.latents import latent_mask

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = self.encode_pixels(encoders.vae, batch.pixels)
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape, video=True)
            if batch.audio is not None:
                from diffpipe_minimax.audio import encode_audio

                frames = batch.pixels.shape[2] if batch.pixels.ndim == 5 else 1
                out["audio_latents"] = encode_audio(encoders.audio_vae, batch.audio, frames)
                out["audio_mask"] = batch.audio_present.float().cpu()
        if batch.captions is not None:
            out.update(self.encode_captions(encoders, list(batch.captions)))
        return out

    @staticmethod
    def encode_pixels(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels`` in [-1, 1] ((B, 3, H, W) or (B, 3, F, H, W)) through ``encode_vae_condition``, item by item."""
        import torch
        from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline as Pipe

        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        param = next(vae.parameters())
        scaled = (pixels.float() + 1.0) * 127.5  # the pipeline's uint8 scale, which it divides by 255
        mean, std = Pipe.pixel_mean.fget(None), Pipe.pixel_std.fget(None)  # type: ignore[attr-defined]
        seed = Pipe.keyframe_encode_seed.fget(None)  # type: ignore[attr-defined]
        with torch.no_grad():
            items = [encode_vae_condition(vae, scaled[i : i + 1].to(param.device, param.dtype), mean, std, seed)
                     for i in range(pixels.shape[0])]
        return torch.cat(items).float()

    @staticmethod
    def encode_captions(encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """``text_embeds`` and ``text_mask`` of each caption, zero-padded to ``text_max_length``; a caption of more
        tokens is refused, naming it; an empty caption (dropout's) has no tokens."""
        import torch
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

        length = encoders.config.text_max_length
        width = encoders.text_encoder.config.text_config.hidden_size
        embeds = torch.zeros(len(captions), length, width)
        mask = torch.zeros(len(captions), length, dtype=torch.bool)
        for row, caption in enumerate(captions):
            ids = encoders.tokenizer(caption, add_special_tokens=False)["input_ids"]
            if len(ids) > length:
                shown = caption if len(caption) <= 80 else caption[:77] + "..."
                raise ValueError(f"caption {shown!r} is {len(ids)} Qwen3-VL tokens, over [model] text_max_length = "
                                 f"{length}; raise it or shorten the caption")
            if not ids:
                continue
            with torch.no_grad():
                e = get_qwen3vl_prompt_embeds(encoders.text_encoder, encoders.processor, ids, {}, TEXT_LAYER,
                                              device=encoders.device, dtype=torch.float32)
            embeds[row, : len(ids)], mask[row, : len(ids)] = e[0].cpu(), True
        return {"text_embeds": embeds, "text_mask": mask}

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: MiniMaxH3Config) -> list[nn.Module]:
        """The embedders (with the text refiner), each block, the output head (:mod:`diffpipe_minimax.layers`)."""
        from diffpipe_minimax import layers

        return layers.split_into_layers(model)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """The first layer's inputs (:mod:`diffpipe_minimax.layers`) and ``(video target, audio target, video
        weight, audio weight)``: rectified flow on the video latents at the run's times (``shift``), then with
        cached sound the audio noise at the paired audio level; targets are the data-ward velocity ``x0 - noise``."""
        from diffpipe_minimax.training import training_inputs

        config = self.model_folder_config(context.model_config)
        return training_inputs(batch, context, generator, self.patch_size(context.model_config),
                               int(config.get("audio_in_channels", 32)))

    @hookimpl
    def compute_loss(self, outputs, targets, context: TrainingContext) -> torch.Tensor:
        """Every video and audio value in the loss counts the same (the run's elementwise loss, weighted)."""
        from diffpipe_minimax.training import joint_loss

        return joint_loss(outputs, targets, context)

    # ------------------------------------------------------------------------------------------ sampling
    def _grid(self, latents: torch.Tensor) -> Any:
        if latents.shape[1] not in self._grids:
            raise ValueError(f"minimax-h3: latents of {latents.shape[1]} values were not made by its denoise_init")
        return self._grids[latents.shape[1]]

    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: MiniMaxH3Config, generator: torch.Generator):
        """The pipeline's noise (video latents, then audio rows) joined, and the video sigmas of the folder's
        ``scheduler`` (``[sample] steps`` model evaluations; the audio sigmas of ``audio_scheduler`` go with them)."""
        from diffpipe_minimax import sampling

        folder = self.model_folder(model_config)
        latents, sigmas, grid = sampling.init(
            self.folder.config(folder, "vae"), self.folder.config(folder, "audio_vae"),
            self.model_folder_config(model_config), folder, request.frames, request.height, request.width,
            request.steps, generator)
        self._grids[latents.shape[1]] = grid
        return latents, sigmas

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's inputs at step ``index`` (both streams at their own levels)."""
        from diffpipe_minimax import sampling

        return sampling.inputs(latents, schedule, index, text, self._grid(latents))

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """``MiniMaxH3Scheduler.step`` for the video rows and the audio rows, each down its own schedule."""
        from diffpipe_minimax import sampling

        return sampling.step(latents, prediction, schedule, index, self._grid(latents))

    @hookimpl
    def load_decoder(self, model_config: MiniMaxH3Config, device: Any) -> Any:
        """The video VAE, holding the audio VAE as ``diffpipe_audio`` (samples then have sound)."""
        from diffpipe_core.parts.encoders import load_components

        enc = load_components(self.folder, model_config, device, "vae", "audio_vae")
        enc.vae.diffpipe_audio = enc.audio_vae
        return enc.vae

    @hookimpl
    def decode_latents(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """The video rows decoded as the pipeline decodes them: float RGB in [-1, 1], ``(B, 3, F, H, W)``."""
        from diffpipe_minimax import sampling

        return sampling.decode_video(decoder, latents, self._grid(latents))

    @hookimpl
    def decode_audio(self, decoder: Any, latents: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The audio rows through the audio VAE as the pipeline decodes them: ``((B, 2, S), sampling_rate)``."""
        from diffpipe_minimax import sampling

        audio_vae = decoder.diffpipe_audio
        wave = sampling.decode_audio(audio_vae, latents, self._grid(latents))
        return wave.clamp(-1, 1), int(audio_vae.config.sampling_rate)


plugin = MiniMaxH3()
