"""The LTX-2 model plugin (entry point ``ltx-2``) on the core's shared plugin parts: the video branch of LTX-2's
audio-video transformer trains, and with ``[model] train_audio`` the audio branch on the clips' sound (the core's
audio data path, :mod:`diffpipe_ltx.ltx2_audio`), or the audio branch alone (``train_video = false``).

``prepare_inputs`` gives the first pipeline layer ``(x, t, audio_x, video_text, audio_text, text_mask, grid)``
(:mod:`diffpipe_ltx.ltx2_layers`): the packed noisy video latents, each latent frame's flow time (0 on a first frame
conditioned as ``LTX2ImageToVideoPipeline`` conditions it), the packed audio latents, the connectors' text for each
stream and its mask, and the latent ``(F, H, W)``. Without cached sound (``train_audio`` off) the audio stream gets what
``LTX2Pipeline`` gives it when no ``audio_latents`` are passed: Gaussian noise of the clip's duration
(``prepare_audio_latents``, drawn after the video's noise), at the video's time (the pipeline passes one timestep
to both streams, ``sigma = timestep``), and the audio part of the output weighs 0; with cached ``audio_latents`` they
are noised at the sample's time and their velocity is in the loss (per item the video's mean error plus the audio's,
as the LTX-2 trainer sums them).
Samples (with sound) are text-to-video as ``LTX2Pipeline`` generates them, or with ``[model] sample_image``
image-to-video as ``LTX2ImageToVideoPipeline`` does (the image's latents as the clean first latent frame, at time 0,
kept through the steps). This module imports no torch, diffusers or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.file_variant import Shape, blocks, weight_of
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder, SizeMatch
from diffpipe_core.parts.plugin import DiffusersModel, diffusers_spec
from diffpipe_core.parts.sampling import FlowSampling, SampleImageConditioning
from diffpipe_ltx.config import LTX2Config
from diffpipe_ltx.lightricks_vae import ltx2_audio_vae_table, ltx2_vae_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import AudioSpec, EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest

FRAME_RATE = 24  # LTX2Pipeline's default frame_rate; videos are resampled to it (ModelSpec.video_fps)
PIPELINES = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
COMPONENTS = {
    "transformer": "LTX2VideoTransformer3DModel",
    "vae": "AutoencoderKLLTX2Video",
    "audio_vae": "AutoencoderKLLTX2Audio",
    "text_encoder": "Gemma3ForConditionalGeneration",
    "tokenizer": TOKENIZER,
    "connectors": "diffusers.pipelines.ltx2.connectors:LTX2TextConnectors",
}
SIZES = (
    SizeMatch("connectors", "caption_channels", "caption_channels", 3840),
    SizeMatch("vae", "latent_channels", "in_channels", 128),
)
AUDIO_COMPRESSION = 4  # AutoencoderKLLTX2Audio's temporal and mel compression (LATENT_DOWNSAMPLE_FACTOR)
# the audio stream's modules in every block: its self- and text cross-attention, its feed-forward, and the two
# audio-video cross-attentions (the coupling); LoRA targets with [model] train_audio
AUDIO_LORA_TARGETS = tuple(
    f"{a}.{p}" for a in ("audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    for p in ("to_q", "to_k", "to_v", "to_out.0")
) + ("audio_ff.net.0.proj", "audio_ff.net.2")


def ltx2_spec(name: str, config: type[LTX2Config], description: str) -> Any:
    """The ``ModelSpec`` of the LTX-2 family (``ltx-2``, ``ltx-2.3``, ``ltx-2.5``): 8k + 1 frames at 24 fps, sizes
    multiples of 32, an optional first frame."""
    return diffusers_spec(
        name, config, description, video=(8, 1, FRAME_RATE), spatial_multiple=32,
        encoder_settings=("max_sequence_length",), block_layers=("BlockLayer",), first_frame="optional",
    )


@dataclass(frozen=True)
class Geometry:
    """What ``LTX2Pipeline`` derives from the folder's configs: VAE compression, the audio latents' rate and size."""

    temporal: int
    spatial: int
    channels: int
    audio_per_second: float
    audio_channels: int
    audio_mel: int

    def audio_frames(self, latent_frames: int) -> int:
        """``round(num_frames / frame_rate * audio latents per second)`` for ``latent_frames`` video frames."""
        return round(((latent_frames - 1) * self.temporal + 1) / FRAME_RATE * self.audio_per_second)

    def audio_shape(self, batch: int, latent_frames: int) -> tuple[int, int, int, int]:
        return batch, self.audio_channels, self.audio_frames(latent_frames), self.audio_mel


def is_ltx23(config: dict[str, Any]) -> bool:
    """Whether a transformer config has LTX-2.3's layout (text cross-attention modulation, no caption projection)."""
    return bool(config.get("cross_attn_mod") or config.get("audio_cross_attn_mod")
                or not config.get("use_prompt_embeddings", True))


class LTX2Folder(DiffusersFolder):
    """LTX-2's folder, whose text connectors also come from a ``diffusion_model`` file that holds them (the original
    checkpoint, ``ltx-2-19b-dev.safetensors``, keeps them beside the transformer, as ComfyUI loads them)."""

    def component_files(self, path: Path, model_config: Any) -> dict[str, Any]:
        """:meth:`DiffusersFolder.component_files`, and ``connectors`` from the ``diffusion_model`` file when its keys
        hold all of them (:func:`diffpipe_ltx.ltx2_original.connectors_table`)."""
        found = super().component_files(path, model_config)
        single = getattr(model_config, "diffusion_model", None)
        if single is None or not Path(single).is_file():
            return found
        import torch

        from diffpipe_core.component_files import fit_file, model_shapes, read_component_file
        from diffpipe_ltx.ltx2_original import connectors_table

        header = read_component_file(single, "diffusion_model")
        table = connectors_table(self.model_config(path, "connectors"))
        fit = fit_file(header, model_shapes(self.skeleton(path, "connectors", torch.float32)), [table])
        if fit is not None and fit.complete and fit.table is table:
            found["connectors"] = (header, fit)
        return found


class LTX2(SampleImageConditioning, DiffusersModel, FlowSampling):
    """LTX-2: video (and images as one-frame videos) with first-frame conditioning; VAE 32x spatial, 8x temporal:
    frames 8k + 1 at 24 fps."""
    #: no GPU-fit table (diffpipe_core.engine.fit_table) yet: its samples start from a first frame, whose encoding a
    #: config-only folder cannot make (and its Gemma text connectors' sizes are still to be sourced)
    plan_size = None
    tiny_writer = "diffpipe_ltx.ltx2_testing:write_tiny_ltx2"  # python -m diffpipe_core.testing.tiny_models

    spec = ltx2_spec(
        "ltx-2", LTX2Config, "LTX-2 video branch (diffusers folder or original Lightricks single-file transformer)"
    )
    folder = LTX2Folder(
        "ltx-2", PIPELINES, COMPONENTS, sizes=SIZES, single_file_example="ltx-2-19b-dev.safetensors",
        file_layouts={"vae": ltx2_vae_table, "audio_vae": ltx2_audio_vae_table},
        file_optional={"text_encoder": ("model.vision_tower.", "model.multi_modal_projector.")},
    )
    model_class = "LTX2VideoTransformer3DModel"
    single_file_markers = ("patchify_proj.weight", "audio_patchify_proj.weight")
    file_config = {  # block count and widths from the file itself (Lightricks' or diffusers' names)
        "num_layers": blocks("transformer_blocks"),
        "attention_head_dim": Shape(weight_of("patchify_proj", "proj_in"), 0, per="num_attention_heads"),
        "in_channels": Shape(weight_of("patchify_proj", "proj_in"), 1),
        "cross_attention_dim": Shape(weight_of("transformer_blocks.0.attn2.to_k"), 1),
        "audio_attention_head_dim": Shape(
            weight_of("audio_patchify_proj", "audio_proj_in"), 0, per="audio_num_attention_heads"
        ),
        "audio_in_channels": Shape(weight_of("audio_patchify_proj", "audio_proj_in"), 1),
        "audio_cross_attention_dim": Shape(weight_of("transformer_blocks.0.audio_attn2.to_k"), 1),
    }
    single_file_name = "ltx2-transformer.safetensors"
    # the video stream's self-attention (attn1), text cross-attention (attn2) and feed-forward of every block; the
    # audio stream's modules (audio_attn1, audio_ff, ...) and the audio-video cross-attentions stay frozen
    lora_target_names = tuple(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")) + (
        "ff.net.0.proj", "ff.net.2",
    )
    key_tables = "diffpipe_ltx.ltx2_original"
    encoder_components = ("vae", "text_encoder", "tokenizer", "connectors")  # caching: the video VAE, Gemma 3, ...

    def __init__(self) -> None:
        self._grids: dict[int, tuple[int, int, int, int]] = {}  # sample latents' size -> (F, H, W, audio frames)

    def geometry(self, model_config: LTX2Config) -> Geometry:
        vae = self.folder.config(model_config.path, "vae")
        audio = self.folder.config(model_config.path, "audio_vae")
        levels = sum(bool(s) for s in vae.get("spatio_temporal_scaling", (True,) * 4))
        spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 2**levels
        temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2**levels
        per_second = audio.get("sample_rate", 16000) / audio.get("mel_hop_length", 160) / AUDIO_COMPRESSION
        return Geometry(int(temporal), int(spatial), int(self.model_folder_config(model_config)["in_channels"]),
                        per_second, int(audio.get("latent_channels", 8)), int(audio.get("mel_bins", 64)) // 4)

    def default_lora_targets(self, model_config: LTX2Config) -> list[str]:
        """The video stream's targets with ``train_video``, the audio stream's and the audio-video cross-attentions'
        (:data:`AUDIO_LORA_TARGETS`) with ``train_audio``."""
        return [*(self.lora_target_names if model_config.train_video else ()),
                *(AUDIO_LORA_TARGETS if model_config.train_audio else ())]

    @hookimpl
    def audio_spec(self, model_config: LTX2Config) -> AudioSpec | None:
        """With ``train_audio``: the audio VAE's ``sample_rate`` and input channels (stereo in LTX-2); a damaged track
        trains without audio, as a clip without one does. None otherwise (no audio is read)."""
        if not model_config.train_audio:
            return None
        from diffpipe_core import AudioSpec

        audio = self.folder.config(model_config.path, "audio_vae")
        return AudioSpec(int(audio.get("sample_rate", 16000)), min(2, int(audio.get("in_channels", 2))))

    @hookimpl
    def load_encoders(self, model_config: LTX2Config, device: Any) -> Any:
        """The video VAE, Gemma 3, its tokenizer and the connectors; with ``train_audio`` the audio VAE too."""
        from diffpipe_core.parts.encoders import load_components

        extra = ("audio_vae",) if model_config.train_audio else ()
        return load_components(self.folder, model_config, device, *self.encoder_components, *extra)

    def build_skeleton(self, model_config: LTX2Config, device: Any, dtype: torch.dtype) -> nn.Module:
        config = self.model_folder_config(model_config)
        file = model_config.path / "transformer" / "config.json"
        if (config.get("patch_size", 1), config.get("patch_size_t", 1), config.get("audio_patch_size", 1)) != (1,) * 3:
            raise ValueError(f"{file}: patch sizes other than 1; diffpipe-ltx supports LTX-2's (all 1)")
        self.check_layout(config, file)
        return super().build_skeleton(model_config, device, dtype)

    def check_layout(self, config: dict[str, Any], file: Path) -> None:
        """``ltx-2`` trains LTX-2.0 transformers; an LTX-2.3-style one is refused, naming the entry point for it."""
        if is_ltx23(config):
            raise ValueError(
                f"{file}: an LTX-2.3-style transformer (cross_attn_mod / no caption projection); ltx-2 trains "
                "LTX-2.0 transformers: use [model] type = \"ltx-2.3\" (or \"ltx-2.5\" for an LTX25ModularPipeline "
                "folder)"
            )

    @hookimpl
    def validate_model_files(self, model_config: LTX2Config) -> list[str]:
        """The folder and single file (the shared checks), the transformer's layout (:meth:`check_layout`), and that
        ``max_sequence_length`` is a multiple of the connectors' learnable registers (``LTX2ConnectorTransformer1d``
        refuses other lengths)."""
        found = super().validate_model_files(model_config)
        if found:
            return found
        try:
            file = model_config.path / "transformer" / "config.json"
            self.check_layout(self.model_folder_config(model_config), file)
        except ValueError as refused:
            return [str(refused)]
        connectors = self.folder.config(model_config.path, "connectors")
        registers = connectors.get("video_connector_num_learnable_registers", 128)
        if registers and model_config.max_sequence_length % registers:
            found.append(
                f"[model] max_sequence_length {model_config.max_sequence_length} is not a multiple of the "
                f"{registers} learnable registers of {model_config.path / 'connectors' / 'config.json'}"
            )
        return found

    # ------------------------------------------------------------------------------------------ caching
    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, F, H/32, W/32) normalised as ``LTX2Pipeline._normalize_latents`` (images are one
        frame), ``mask`` (B, 1, 1, h, w) when given, and for a clip ``first_frame_latents`` (B, C, 1, h, w): its first
        frame encoded alone and normalised as ``LTX2ImageToVideoPipeline.prepare_latents`` does the image (without the
        scaling factor). Captions: ``video_text``, ``audio_text`` (B, max_sequence_length, d) and ``text_mask``,
        what the connectors make of ``LTX2Pipeline.encode_prompt``'s Gemma hidden states (the transformer's
        ``encoder_hidden_states``, ``audio_encoder_hidden_states`` and ``encoder_attention_mask``)."""
        from diffpipe_core.parts.latents import latent_mask
        from diffpipe_ltx.packing import encode_latents

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = encode_latents(encoders.vae, batch.pixels)
            if batch.masks is not None:
                out["mask"] = latent_mask(batch.masks, out["latents"].shape, video=True)
            if batch.first_frames is not None:
                out["first_frame_latents"] = encode_latents(encoders.vae, batch.first_frames, scale=False)
            if batch.audio is not None:
                out.update(self.encode_sound(encoders.audio_vae, batch))
        if batch.captions is not None:
            out.update(self.encode_text(encoders, batch.captions))
        return out

    def encode_sound(self, audio_vae: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """``audio_latents`` (B, L, C * M): the batch's sound through the audio VAE, packed and normalised as
        ``LTX2Pipeline`` packs and normalises audio latents, ``L`` the pipeline's audio latent length for the clip's
        frame count (:mod:`diffpipe_ltx.ltx2_audio`); ``audio_mask`` (B,): 1 where the item has sound."""
        from diffpipe_ltx.ltx2_audio import encode_audio

        config = audio_vae.config
        frames = batch.pixels.shape[2] if batch.pixels.ndim == 5 else 1
        per_second = config.sample_rate / config.mel_hop_length / AUDIO_COMPRESSION
        length = round(frames / FRAME_RATE * per_second)  # LTX2Pipeline's audio_num_frames
        return {"audio_latents": encode_audio(audio_vae, batch.audio, length),
                "audio_mask": batch.audio_present.float().cpu()}

    def encode_text(self, encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """``LTX2Pipeline.encode_prompt`` (Gemma 3's hidden states of every layer, left-padded) through the
        pipeline's connectors, as ``LTX2Pipeline.__call__`` runs them."""
        import torch

        from diffpipe_core.parts.text import text_pipeline

        pipe = text_pipeline("LTX2Pipeline", text_encoder=encoders.text_encoder, tokenizer=encoders.tokenizer,
                             connectors=encoders.connectors)
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            embeds, mask, _, _ = pipe.encode_prompt(
                captions, do_classifier_free_guidance=False, max_sequence_length=encoders.config.max_sequence_length,
                device=device,
            )
            side = getattr(encoders.tokenizer, "padding_side", "left")
            video, audio, text_mask = encoders.connectors(embeds, mask, padding_side=side)
        return {
            "video_text": video.float().cpu(), "audio_text": audio.float().cpu(), "text_mask": text_mask.bool().cpu()
        }

    # ------------------------------------------------------------------------------------------ training
    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: LTX2Config) -> list[nn.Module]:
        """Embedders, each audio-video block, the output norms and projections."""
        from diffpipe_ltx import ltx2_layers

        return ltx2_layers.split_into_layers(model, float(FRAME_RATE))

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """``((x, t, audio_x, video_text, audio_text, text_mask, grid), (target, weight))`` (module docstring):
        rectified flow (:func:`diffpipe_core.parts.flow.flow_sample`, with ``shift`` or LTX2Pipeline's resolution
        shift), then the first-frame conditioning draw, then the audio noise; all randomness from ``generator``."""
        import torch

        from diffpipe_core.diffusion import first_frame_conditioning, flux_resolution_shift
        from diffpipe_core.parts.flow import flow_sample
        from diffpipe_ltx.geometry import shift_constants
        from diffpipe_ltx.ltx2_layers import join, per_item_mean
        from diffpipe_ltx.packing import pack

        cfg: LTX2Config = context.model_config  # type: ignore[assignment]
        latents = batch["latents"].float()
        b, _, f, h, w = latents.shape
        shift = flux_resolution_shift(f * h * w, *shift_constants(cfg)) if cfg.resolution_shift else cfg.shift
        s = flow_sample(latents, cfg, context, generator, shift)
        # LTX2ImageToVideoPipeline's init_latents * mask + noise * (1 - mask): the clip's first frame encoded alone
        first = batch.get("first_frame_latents")
        clean = latents if first is None else torch.cat([first.float(), latents[:, :, 1:]], dim=2)
        p, evaluating = cfg.first_frame_conditioning_p, context.eval_quantile is not None
        c = first_frame_conditioning(clean, s.x_t, s.t, p, generator, evaluating)
        x_t, frame_t, weight = c.x_t, c.frame_t, c.weight
        if "mask" in batch:
            weight = weight * batch["mask"].float()
        noise = torch.randn(self.geometry(cfg).audio_shape(b, f), generator=generator)
        noise = noise.transpose(1, 2).flatten(2, 3)  # LTX2Pipeline._pack_audio_latents
        video_weight = pack(weight).expand(-1, -1, latents.shape[1]) * float(cfg.train_video)
        clean = batch.get("audio_latents")
        if clean is None:  # no sound cached: the pipeline's pure noise, outside the loss
            audio, audio_target, audio_weight = noise, torch.zeros_like(noise), torch.zeros_like(noise)
        else:  # rectified flow at the sample's time (the audio stream's; a conditioned first frame keeps it too)
            clean, ta = clean.float(), s.t.float().view(b, 1, 1)
            audio, audio_target = (1 - ta) * clean + ta * noise, noise - clean
            present = batch["audio_mask"].float().view(b, 1, 1) * float(cfg.train_audio)
            audio_weight = present.expand_as(audio).clone()
        if cfg.train_audio:  # LTX-2's trainer: per item, each stream's mean error, summed (compute_loss)
            video_weight, audio_weight = per_item_mean(video_weight), per_item_mean(audio_weight)
        grid = torch.tensor([f, h, w], dtype=torch.long)
        inputs = (pack(x_t), frame_t, audio, batch["video_text"].float(), batch["audio_text"].float(),
                  batch["text_mask"].bool(), grid)
        target = join(pack(s.target), audio_target)
        return inputs, (target, join(video_weight, audio_weight))

    @hookimpl
    def compute_loss(
        self, outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...], context: TrainingContext
    ) -> torch.Tensor:
        """The run's loss of the prediction to the velocity. With ``train_audio`` it is the LTX-2 trainer's
        (``ltx_trainer.training_strategies``' ``compute_loss``): per item, the video stream's mean error over its
        weighted tokens plus the audio stream's mean error, the sum averaged over the items with anything in the
        loss. ``prepare_inputs`` gives each stream's weights of an item the sum 1 (0 where it has no part), so
        that sum over items is the weighted mean times the weights' sum."""
        from diffpipe_core.parts.flow import flow_loss

        loss = flow_loss(outputs, targets, context)
        if not getattr(context.model_config, "train_audio", False):
            return loss
        per_item = targets[1].flatten(1).sum(1).to(loss.device, loss.dtype)
        return loss * per_item.sum() / (per_item > 0).sum().clamp_min(1)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def denoise_init(self, request: SampleRequest, model_config: LTX2Config, generator: torch.Generator):
        """Video noise ``(1, C, (F - 1) / 8 + 1, H / 32, W / 32)`` then audio noise, as ``LTX2Pipeline`` draws them,
        packed and side by side (:func:`diffpipe_ltx.ltx2_layers.join`), and the folder's scheduler sigmas of
        ``linspace(1, 1/steps, steps)`` with the pipeline's sequence-length shift (``shift_terminal`` too). With
        ``[model] sample_image`` the first latent frame is the image's latents (:meth:`encode_sample_image`), as
        ``LTX2ImageToVideoPipeline.prepare_latents`` puts them over the same noise."""
        import numpy as np
        import torch

        from diffpipe_core.sampling.schedules import scheduler_flow_sigmas
        from diffpipe_ltx.ltx2_layers import join
        from diffpipe_ltx.packing import pack

        g = self.geometry(model_config)
        f, h, w = (request.frames - 1) // g.temporal + 1, request.height // g.spatial, request.width // g.spatial
        video = torch.randn((1, g.channels, f, h, w), generator=generator)
        if model_config.sample_image is not None:
            if f < 2:
                raise ValueError(
                    f"ltx-2: image-to-video samples ([model] sample_image) need more than {g.temporal} frames "
                    f"(at least 2 latent frames); got {request.frames}"
                )
            video[:, :, :1] = self.sample_condition(model_config, request)["latents"]
        audio_shape = (1, g.audio_channels, round(request.frames / FRAME_RATE * g.audio_per_second), g.audio_mel)
        audio = torch.randn(audio_shape, generator=generator).transpose(1, 2).flatten(2, 3)
        latents = join(pack(video), audio)
        self._grids[latents.shape[1]] = (f, h, w, audio.shape[1])
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        return latents, scheduler_flow_sigmas(model_config.path, sigmas, f * h * w)

    def _grid(self, latents: torch.Tensor) -> tuple[int, int, int, int]:
        if latents.shape[1] not in self._grids:
            raise ValueError(f"ltx-2: latents of {latents.shape[1]} values were not made by this plugin's denoise_init")
        return self._grids[latents.shape[1]]

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """The first layer's inputs (module docstring) for the sample's video and audio latents at ``index``; with
        ``[model] sample_image`` the first latent frame's time is 0 (``LTX2ImageToVideoPipeline``'s
        ``timestep * (1 - conditioning_mask)``), the audio's stays the step's."""
        import torch

        from diffpipe_ltx.ltx2_layers import split

        f, h, w, audio_frames = self._grid(latents)
        video, audio = split(latents.float(), f * h * w, self.geometry(model_config).channels, audio_frames)
        b = latents.shape[0]
        t = schedule[index].float().expand(b, f).clone()
        if model_config.sample_image is not None:
            t[:, 0] = 0.0
        grid = torch.tensor([f, h, w], dtype=torch.long)
        return (video, t, audio, text["video_text"].float(), text["audio_text"].float(), text["text_mask"].bool(),
                grid)

    @hookimpl
    def denoise_step(self, latents, prediction, schedule, index, model_config):
        """The flow step (:class:`~diffpipe_core.parts.sampling.FlowSampling`); with ``[model] sample_image`` the
        first latent frame's tokens keep the image's latents (``LTX2ImageToVideoPipeline`` steps only the others)."""
        stepped = super().denoise_step(latents, prediction, schedule, index, model_config)
        if model_config.sample_image is not None:
            _, h, w, _ = self._grid(latents)
            kept = h * w * self.geometry(model_config).channels  # the flat video tokens of latent frame 0 come first
            stepped[:, :kept] = latents[:, :kept].to(stepped.dtype)
        return stepped

    def encode_sample_image(self, model_config: LTX2Config, request: SampleRequest) -> dict[str, Any]:
        """``latents`` (1, C, 1, h, w) of ``[model] sample_image`` as ``LTX2ImageToVideoPipeline`` computes them
        from its ``image``: H.264 re-compressed at the pipeline's default CRF for the folder's text encoder (none on
        a diffusers without it), resized to the sample size (bilinear), encoded alone (the posterior's mode) and
        normalised without the scaling factor, as the training side encodes a clip's first frame."""
        from types import SimpleNamespace

        import numpy as np
        import torch
        from diffusers.video_processor import VideoProcessor
        from PIL import Image

        from diffpipe_core.parts.encoders import load_components
        from diffpipe_ltx.packing import encode_latents

        with Image.open(model_config.sample_image) as opened:
            image = opened.convert("RGB")
        try:
            from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
        except ImportError:  # a diffusers whose pipeline does not re-compress its image
            crf = 0
        else:
            model_type = self.folder.config(model_config.path, "text_encoder").get("model_type")
            crf = resolve_default_image_crf(SimpleNamespace(config=SimpleNamespace(model_type=model_type)))
        if crf:
            image = Image.fromarray(apply_image_conditioning_crf(np.array(image), crf))
        processor = VideoProcessor(vae_scale_factor=self.geometry(model_config).spatial, resample="bilinear")
        pixels = processor.preprocess(image, height=request.height, width=request.width)
        vae = load_components(self.folder, model_config, torch.device("cpu"), "vae").vae
        with torch.no_grad():
            return {"latents": encode_latents(vae, pixels.float(), scale=False).float()}

    @hookimpl
    def load_decoder(self, model_config: LTX2Config, device: Any) -> Any:
        """The video VAE; with the ``audio_vae`` (the folder's, or ``[model] audio_vae``) and the folder's ``vocoder``
        (``LTX2Vocoder``) held by it as ``diffpipe_audio`` when the weights of both are there (samples then have
        sound; a config-only folder without the vocoder's weights gives silent samples), with ``latent_mel`` the audio
        latents' mel width."""
        from diffpipe_core.parts.encoders import torch_dtype

        vae = super().load_decoder(model_config, device)
        path = self.model_folder(model_config)
        given = self.folder.component_files(path, model_config).get("audio_vae")

        def weights(component: str) -> bool:
            return any((path / component).glob("*.safetensors")) or any((path / component).glob("*.bin"))

        if not (weights("vocoder") and (given is not None or weights("audio_vae"))):
            return vae  # a config-only folder without them: silent samples
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
        from torch import nn

        dtype = torch_dtype(model_config.encoder_dtype)
        audio_vae = self.folder.load(path, "audio_vae", dtype, device, given)
        vocoder = LTX2Vocoder.from_pretrained(str(path / "vocoder"), torch_dtype=dtype, local_files_only=True)
        vae.diffpipe_audio = nn.ModuleDict({"audio_vae": audio_vae, "vocoder": vocoder.to(device).eval()})
        vae.diffpipe_audio.latent_mel = self.geometry(model_config).audio_mel
        return vae

    @hookimpl
    def decode_audio(self, decoder: Any, latents: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The sample's audio latents through the audio VAE and vocoder, as ``LTX2Pipeline`` decodes them
        (:func:`diffpipe_ltx.ltx2_audio.decode_audio`): ``((B, 2, S), the vocoder's output_sampling_rate)``; None when
        the folder has no audio VAE and vocoder."""
        from diffpipe_ltx.ltx2_audio import decode_audio
        from diffpipe_ltx.ltx2_layers import split

        parts = getattr(decoder, "diffpipe_audio", None)
        if parts is None:
            return None
        f, h, w, audio_frames = self._grid(latents)
        _, audio = split(latents.float(), f * h * w, int(decoder.config.latent_channels), audio_frames)
        wave = decode_audio(parts["audio_vae"], parts["vocoder"], audio, parts.latent_mel)
        return wave.clamp(-1, 1), int(parts["vocoder"].config.output_sampling_rate)

    @hookimpl
    def decode_latents(self, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """The video part of the latents, unpacked and denormalised (``LTX2Pipeline._denormalize_latents``), through
        the VAE (decode timestep 0 when it is timestep-conditioned); float RGB in [-1, 1], ``(B, 3, F, H, W)``. The
        audio part is not decoded (samples are silent MP4s)."""
        import torch

        from diffpipe_core.parts.latents import denormalize
        from diffpipe_ltx.ltx2_layers import split
        from diffpipe_ltx.packing import unpack

        f, h, w, audio_frames = self._grid(latents)
        video, _ = split(latents.float(), f * h * w, int(decoder.config.latent_channels), audio_frames)
        with torch.no_grad():
            z = denormalize(unpack(video, f, h, w), decoder.latents_mean, decoder.latents_std,
                            decoder.config.scaling_factor)
            param = next(decoder.parameters())
            timestep = torch.zeros(z.shape[0], device=param.device, dtype=param.dtype)
            timestep = timestep if decoder.config.timestep_conditioning else None
            return decoder.decode(z.to(param.device, param.dtype), timestep).sample.float().clamp(-1, 1)


ltx2 = LTX2()
