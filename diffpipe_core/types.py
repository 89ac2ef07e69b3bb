"""Plain data types that cross the plugin boundary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # annotations only: importing the contract must not import torch (fast CLI start)
    import torch


class MergedAdapter(BaseModel):
    """One entry of ``[model] merge_adapters``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path = Field(description="The adapter: a saved folder or its safetensors file.")
    weight: float = Field(1.0, description="Strength the adapter is merged at (1.0: as trained).")


class ModelConfigBase(BaseModel):
    """Base class for a plugin's ``[model]`` schema.

    Subclass it, declare fields with types, defaults and ``Field(description=...)``; unknown keys are
    rejected with a close spelling, and every field appears in ``diffpipe config-reference``.
    ``type`` (the model name), ``dtype`` and ``quantize`` are common to every model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(description="The model plugin's name (`diffpipe models` lists them), or `--model`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of the diffusion model's weights (a plugin may set another default)."
    )
    quantize: Literal["nf4", "int8", "float8", "float8_e5m2"] | None = Field(
        None,
        description="Quantize the frozen base weights while each pipeline stage loads (LoRA only): 'nf4' or 'int8' "
        "(bitsandbytes), 'float8' (float8_e4m3 storage, per-tensor scale, computed in dtype), 'float8_e5m2' (the "
        "same in float8_e5m2: wider range, coarser steps). Every nn.Linear of "
        "the model's blocks except float32-kept and tiny ones (< 4096 weights); embedders and the final layer keep "
        "dtype. LoRA trains on top; the base is never saved.",
    )
    # --------------------------------------------------------------------- training methods (issue 42)
    merge_adapters: tuple[MergedAdapter, ...] = Field(
        (),
        description="LoRAs merged into the frozen base as each pipeline stage loads, before quantize: "
        "[{ path = \"de-distill.safetensors\", weight = 1.0 }, ...] (a saved adapter folder or file in any layout "
        "diffpipe exports: diffusers, peft, ComfyUI (also the model's native layout) or kohya keys). W += weight * "
        "scale * B @ A, scale = alpha / rank from the file's .alpha tensors, metadata or adapter_config.json. The "
        "trained adapter is saved alone.",
    )
    cfg: float | None = Field(
        None,
        gt=1,
        description="CFG-augmented training of a guidance-distilled model: each step also runs the model on the "
        "empty prompt (no gradient, one extra forward) and trains (output + (cfg - 1) * uncond) / cfg toward the "
        "target, so the model keeps its distilled guidance scale cfg. Leave out for plain training.",
    )


#: The files a model may read paired with each item (``ModelSpec.paired_files``) -> the ``[[directory]]`` key giving
#: their folder.
PAIRED_ROLES = {"control_mask": "control_mask_path", "reference": "reference_path", "last_frame": "last_frame_path"}


@dataclass(frozen=True)
class ModelSpec:
    """What the core needs to know about a model before loading anything.

    Attributes:
        name: the model name; must equal the entry-point name.
        modality: ``"image"`` or ``"video"``.
        config_schema: the pydantic class validating the run config's ``[model]`` table.
        spatial_multiple: pixel sizes are rounded down to a multiple of this (VAE factor x patch).
        frame_multiple / frame_offset: video frame counts are ``frame_multiple * k + frame_offset``.
        video_fps: frame rate videos are resampled to (video models only).
        supports_full_finetune / supports_lora: what training modes the plugin allows.
        encoder_settings: names of ``[model]`` keys that change encoder outputs; the cache is rebuilt
            when one of them changes.
        block_layers: class names of the layers ``split_into_layers`` returns for the model's repeated blocks
            (e.g. ``("DoubleBlockLayer", "SingleBlockLayer")``). ``blocks_to_swap`` and activation
            checkpointing act on these; with none declared, checkpointing covers every layer and no block swaps.
        sequence_tensors: what the block layers' input tuple holds the token sequence in, for ``sequence_parallel``:
            ``(index, dim)`` pairs, the token stream first (its index is also the token stream's in the last block
            layer's output), then what follows its tokens (a rotary embedding: ``((0, 1), (4, 1), (5, 1))``). The
            core splits these over the sequence ranks before the first block, runs the blocks' self- and joint
            attention through DeepSpeed's Ulysses all-to-all and gathers the tokens after the last block; tokens a
            joint attention appends after the split ones (text) stay replicated. Empty: no sequence parallelism.
        adapter_formats: LoRA formats ``[adapter] save_formats`` may name for this model; ``"diffusers"``
            is always written. ``diffpipe validate`` and the start of ``train`` refuse any other name.
        model_formats: full fine-tune formats ``save_model_formats`` may name (what ``export_model`` writes).
        description: one line shown by ``diffpipe models``.
        control_images: whether the model trains on edit pairs (a target image plus control images, from
            ``[[directory]] control_path``): ``"none"`` (a dataset with ``control_path`` is an error),
            ``"optional"`` (items with and without control images train side by side, in separate micro-batches)
            or ``"required"`` (every ``[[directory]]`` needs a ``control_path``). Control images are encoded by
            ``encode_batch`` (``EncodeBatch.control_index`` set) and reach ``prepare_inputs`` as
            ``control_<k>_<key>`` beside the target's keys.
        max_control_images: how many control images (``control_path`` folders) an item may have.
        control_size: the pixel size a control image is decoded at: ``"target"`` (resized and center-cropped to the
            target's bucket, as diffusion-pipe does; Flux Kontext) or ``"own"`` (its own aspect-ratio bucket at the
            target's resolution, by the directory's bucketing keys; Qwen-Image-Edit, Flux 2 reference images).
        control_sample_area: with ``control_size = "own"``, the pixel area a sample's control images are encoded at
            (their aspect ratio kept, sides rounded to 32 as diffusers' edit pipelines round them) where the
            model's pipeline fixes one whatever the output size (Qwen-Image-Edit's references: 1024*1024); None:
            the sample's pixel count. Training's control images keep their buckets.
        control_videos: ``control_path`` holds control videos instead of images (a video model with
            ``control_images`` set: Wan VACE): each clip pairs with the video of the same relative path and stem,
            decoded at the clip's own frames (the same start, frame rate, count and bucket); ``encode_batch`` gets
            them as ``(B, 3, F, H, W)`` with ``control_index`` set. An image in the dataset, or a clip whose
            control video is missing, unreadable or too short, is an error naming the files before any work.
        paired_files: the files paired with each item the model reads (:data:`PAIRED_ROLES`), each from a
            ``[[directory]]`` key of its own and paired by relative path and stem as ``control_path`` is:
            ``"control_mask"`` (``control_mask_path``: a mask video, or one mask image for every frame, of the
            control video, same size; for ``control_videos`` models; decoded at the control clip's frames and
            bucket; ``EncodeBatch.control_masks``), ``"reference"`` (``reference_path``, one folder or a list: images
            at their own size; ``EncodeBatch.references``, in the control batch of a model with control images, else
            in the target's), ``"last_frame"`` (``last_frame_path``: an image at its own size, in the target's batch;
            ``EncodeBatch.last_frames``). They are decoded and encoded with the item (or its control) they join and
            cached under its key, which holds their content. A directory giving a key the model does not read, or
            an item whose paired file is missing or unreadable, is an error naming the key or the files before any
            work. Items are batched apart by the paired files they have.
        control_in_captions: the model's text encoder looks at the control images (a vision-language encoder:
            Qwen-Image-Edit). Caption batches of items with control images then carry them
            (``EncodeBatch.control_pixels``) and are cached per caption and control images.
        first_frame: image-to-video conditioning on each clip's first frame: ``"none"``; ``"optional"`` (video
            batches carry ``EncodeBatch.first_frames``, image items train as before); ``"required"`` (an
            image-to-video-only model: an image in its dataset is an error naming the file). What ``encode_batch``
            returns for the first frame (image latents, image-encoder embeddings, or both) is cached with the clip.
        guidance_in_one_batch: with classifier-free guidance, sampling runs the negative and the positive prompt as
            one micro-batch of 2 (their text padded to the longer); False: as two micro-batches, each at its own
            length, for a model whose output depends on the text's padding (Qwen-Image 2.1's joint sequence places
            the image after the text, so padding moves its positions).
        unconditional_model: the folder component of a second, frozen diffusion model that runs the unconditional
            branch of classifier-free guidance in samples (Ideogram 4's ``"unconditional_transformer"``): with
            ``[sample] cfg > 1`` the core loads it (:func:`~diffpipe_core.hookspecs.load_unconditional_model`, once,
            in host memory on each pipeline's last stage; on the device only while sampling), feeds it
            :func:`~diffpipe_core.hookspecs.unconditional_inputs` at each step instead of the negative prompt through
            the trained model, and combines the two predictions as usual; None (default): the negative prompt runs
            through the trained model.
        contract: the plugin contract version the plugin is written against and needs
            (``diffpipe_core.CONTRACT_VERSION`` when it was written; ``CHANGELOG.md`` lists the versions). A core
            implementing an older contract refuses the plugin by name, saying which version it needs, instead of
            failing somewhere inside a hook.
    """

    name: str
    modality: Literal["image", "video"]
    config_schema: type[ModelConfigBase]
    spatial_multiple: int = 16
    frame_multiple: int = 1
    frame_offset: int = 0
    video_fps: float | None = None
    supports_full_finetune: bool = True
    supports_lora: bool = True
    encoder_settings: tuple[str, ...] = ()
    block_layers: tuple[str, ...] = ()
    sequence_tensors: tuple[tuple[int, int], ...] = ()
    adapter_formats: tuple[str, ...] = ("diffusers",)
    model_formats: tuple[str, ...] = ()
    description: str = ""
    control_images: Literal["none", "optional", "required"] = "none"
    max_control_images: int = 1
    control_size: Literal["target", "own"] = "target"
    control_sample_area: int | None = None
    control_in_captions: bool = False
    control_videos: bool = False
    paired_files: tuple[str, ...] = ()
    first_frame: Literal["none", "optional", "required"] = "none"
    guidance_in_one_batch: bool = True
    unconditional_model: str | None = None
    contract: int = 1

    def __post_init__(self) -> None:
        choices = {"control_images": ("none", "optional", "required"), "control_size": ("target", "own"),
                   "first_frame": ("none", "optional", "required")}
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ValueError(f"ModelSpec {self.name!r}: {key} is {getattr(self, key)!r}; valid: "
                                 + ", ".join(map(repr, valid)))
        if self.control_sample_area is not None and (self.control_size != "own" or self.control_sample_area < 32 * 32):
            raise ValueError(f"ModelSpec {self.name!r}: control_sample_area is for control_size = 'own', at least "
                             f"32*32 pixels (it is {self.control_sample_area}, control_size {self.control_size!r})")
        if self.max_control_images < 1:
            raise ValueError(f"ModelSpec {self.name!r}: max_control_images must be at least 1")
        if self.control_videos and (self.modality != "video" or self.control_images == "none"):
            raise ValueError(f"ModelSpec {self.name!r}: control_videos is for video models with control_images set "
                             f"(modality {self.modality!r}, control_images {self.control_images!r})")
        unknown = [r for r in self.paired_files if r not in PAIRED_ROLES]
        if unknown or len(set(self.paired_files)) != len(self.paired_files):
            raise ValueError(f"ModelSpec {self.name!r}: paired_files {self.paired_files!r}: each once, of "
                             + ", ".join(map(repr, PAIRED_ROLES)))
        if "control_mask" in self.paired_files and not self.control_videos:
            raise ValueError(f"ModelSpec {self.name!r}: paired_files 'control_mask' is for models with control_videos")
        if self.first_frame != "none" and self.modality != "video":
            raise ValueError(f"ModelSpec {self.name!r}: first_frame conditioning is for video models "
                             f"(modality is {self.modality!r})")


@dataclass(frozen=True)
class AudioSpec:
    """The sound a model trains on, returned by the optional :func:`~diffpipe_core.hookspecs.audio_spec` hook (no
    hook, or None: the model takes no audio and nothing about audio is read).

    Each video's first audio track is decoded over exactly the span of the frames taken (``frames / fps`` seconds from
    the clip's start, clip modes and frame buckets included) and resampled to ``sample_rate``; it reaches
    ``encode_batch`` as ``EncodeBatch.audio`` and is cached with the clip's latents (its cache key includes these
    settings, and the file's content).

    Attributes:
        sample_rate: Hz the waveform is resampled to (e.g. the audio VAE's ``sample_rate``).
        channels: 1 (mono: the channels averaged) or 2 (stereo: a mono track duplicated).
        damaged: what happens to an item whose audio stream cannot be decoded (corrupt, or a codec this PyAV lacks):
            ``"without"`` (it trains without audio, as a video without a track does: a warning names the file and the
            stream) or ``"skip"`` (it is left out of the dataset with the reason, as a video that fails to decode is).
    """

    sample_rate: int
    channels: int = 1
    damaged: Literal["without", "skip"] = "without"

    def __post_init__(self) -> None:
        if self.sample_rate < 1 or self.channels not in (1, 2) or self.damaged not in ("without", "skip"):
            raise ValueError(f"AudioSpec: sample_rate must be >= 1 (is {self.sample_rate}), channels 1 or 2 (is "
                             f"{self.channels}), damaged 'without' or 'skip' (is {self.damaged!r})")

    def samples(self, frames: int, fps: float) -> int:
        """Samples of the span of ``frames`` frames at ``fps``: ``round(frames / fps * sample_rate)``."""
        return max(1, round(frames * self.sample_rate / fps))


@dataclass
class EncodeBatch:
    """One batch handed to ``encode_batch`` while caching.

    The core encodes media and captions in separate calls so that each is cached (and invalidated)
    on its own: a media batch has ``pixels`` set and ``captions`` None, a caption batch the reverse.
    Control images of edit pairs come in media batches of their own, marked by ``control_index``.

    A batch is bucket-homogeneous: every sample has the same shape, so the batch is all images or all
    videos of one frame count. A video model gets both kinds and must encode both.

    Attributes:
        pixels: float RGB in [-1, 1]. Images arrive 4-D ``(B, 3, H, W)``, also in a video model (there is
            no frame axis: add one yourself if your VAE wants ``(B, 3, 1, H, W)``); videos arrive 5-D
            ``(B, 3, F, H, W)`` with ``F`` one of the dataset's ``frame_buckets``.
        captions: the caption strings. Each returned text tensor must have the same length for every
            caption (pad or truncate to a fixed token count): cached samples are stacked into micro-batches.
        masks: ``(B, 1, H, W)`` loss masks in [0, 1] at the pixel size (white = train), or None when the
            dataset has no ``mask_path``. Always 4-D, also for videos: one mask for every frame.
        original_sizes / crop_coords: per-sample ``(h, w)`` before resizing and the crop's top-left,
            for models with micro-conditioning (SDXL's time_ids).
        control_index: set (0, 1, ...) for a batch of control images: ``pixels`` ``(B, 3, H, W)`` are the
            ``control_index``-th control image of their targets (``control_path`` folder number
            ``control_index``), at the size ``ModelSpec.control_size`` gives; ``masks`` is None. Return the tensors
            ``prepare_inputs`` needs of a control image (usually the same VAE latents, normalised as the target's:
            ``{"latents": ...}``); each key ``name`` reaches ``prepare_inputs`` as ``control_<k>_<name>``
            (:func:`control_key`). None for target media and caption batches.
        first_frames: ``(B, 3, H, W)`` in [-1, 1], each clip's first frame at the clip's size, in a video batch of
            a model with ``ModelSpec.first_frame`` set (None for image batches and other models). Return what the
            model is conditioned on (e.g. ``"first_frame_latents"``, ``"image_embeds"`` from an image encoder)
            beside the clip's ``"latents"``: it is cached with the clip.
        control_pixels: in a caption batch of a model with ``ModelSpec.control_in_captions``: per caption the
            tuple of its item's control images, each ``(3, H, W)`` in [-1, 1] at its control size (an empty tuple
            for a caption without control images, such as the empty prompt of caption dropout). None otherwise.
        audio: ``(B, channels, S)`` float32 in [-1, 1], in a media batch of a model with an
            :func:`~diffpipe_core.hookspecs.audio_spec`: each item's sound over its frames' span at ``sample_rate``
            (``S = AudioSpec.samples(frames, fps)``; an image counts as one frame). Zeros where an item has none
            (``audio_present`` False: an image, a video without an audio track, a damaged track with
            ``damaged = "without"``). None for other models, caption batches and control images.
        audio_present: ``(B,)`` bool beside ``audio``: which items have sound. What an item without gets (silence,
            noise, a zero loss weight for its audio) is the model's rule: return what ``prepare_inputs`` needs to
            apply it (e.g. an ``"audio_mask"``).
        control_masks: ``(B, 1, F, H, W)`` in [0, 1] (white = 1), in a control-video batch of a model reading
            ``"control_mask"`` (``ModelSpec.paired_files``) whose items have ``control_mask_path`` files: each control
            video's mask, decoded at its frames and crop (the first channel; a mask image held over every frame).
            None otherwise.
        references: per item, its ``reference_path`` images (one per folder, in order), each ``(3, h, w)`` in
            [-1, 1] at the file's own size, for a model reading ``"reference"``: in its control batch (a model with
            control images) or its target batch; None when the items have none.
        last_frames: per item, its ``last_frame_path`` image ``(3, h, w)`` in [-1, 1] at the file's own size, in a
            target batch of a model reading ``"last_frame"``; None when the items have none.
        negative_prompt: True for a caption batch holding a sample's negative prompt alone (``[sample]
            negative_prompt``, encoded on its own for sampling with classifier-free guidance), for a model whose
            pipeline encodes its negative prompt differently from its prompts (Lumina 2 leaves out its system
            prompt); False for training captions and sample prompts.
    """

    pixels: torch.Tensor | None = None
    captions: list[str] | None = None
    masks: torch.Tensor | None = None
    original_sizes: list[tuple[int, int]] | None = None
    crop_coords: list[tuple[int, int]] | None = None
    control_index: int | None = None
    first_frames: torch.Tensor | None = None
    control_pixels: list[tuple[torch.Tensor, ...]] | None = None
    audio: torch.Tensor | None = None
    audio_present: torch.Tensor | None = None
    control_masks: torch.Tensor | None = None
    references: list[tuple[torch.Tensor, ...]] | None = None
    last_frames: list[torch.Tensor] | None = None
    negative_prompt: bool = False


def control_key(index: int, name: str) -> str:
    """The batch key under which ``prepare_inputs`` finds tensor ``name`` of an item's ``index``-th control image:
    ``control_key(0, "latents") == "control_0_latents"``. A micro-batch holds either every item's control tensors
    or none (items without control images are batched apart)."""
    return f"control_{index}_{name}"


def control_values(source: Mapping[str, Any], name: str) -> list[Any]:
    """Tensor ``name`` of each control image in ``source`` (a micro-batch, or a sample prompt's text tensors), in
    ``control_path`` order: ``control_0_<name>``, ``control_1_<name>``, ... up to the first one missing; empty for an
    item without control images."""
    values = []
    while (value := source.get(control_key(len(values), name))) is not None:
        values.append(value)
    return values


@dataclass(frozen=True)
class LossSettings:
    """The elementwise loss run.toml chooses (at most one is set; none: squared error), which
    :func:`diffpipe_core.diffusion.training_loss` applies.

    Attributes:
        pseudo_huber_c: pseudo-Huber ``sqrt(d^2 + c^2) - c`` (diffusion-pipe's ``pseudo_huber_c``).
        huber_delta: Huber with this delta (``torch.nn.functional.huber_loss``).
        smooth_l1_beta: smooth L1 with this beta (``torch.nn.functional.smooth_l1_loss``).
    """

    pseudo_huber_c: float | None = None
    huber_delta: float | None = None
    smooth_l1_beta: float | None = None

    @property
    def is_mse(self) -> bool:
        return self.pseudo_huber_c is None and self.huber_delta is None and self.smooth_l1_beta is None


@dataclass
class TrainingContext:
    """Facts about the run that ``prepare_inputs`` and ``compute_loss`` may use.

    Attributes:
        model_config: the run's validated ``[model]`` table (an instance of the plugin's ``config_schema``).
        step: the 0-based optimizer step.
        eval_quantile: set while evaluating held-out data: use that quantile of the timestep distribution
            for every sample instead of sampling
            (``diffpipe_core.diffusion.sample_timesteps(..., quantile=context.eval_quantile)`` does it).
        loss: the run's elementwise loss; ``compute_loss`` passes the context to
            :func:`diffpipe_core.diffusion.training_loss`, which applies it.
        extra: empty in this version: room for values a later core or a wrapper plugin adds without a
            contract change; don't rely on a key being present.
    """

    model_config: ModelConfigBase
    step: int = 0
    eval_quantile: float | None = None
    loss: LossSettings = field(default_factory=LossSettings)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SampleRequest:
    """What to generate, handed to the denoising hooks (``denoise_init``, ``denoise_inputs``).

    Attributes:
        width / height: pixel size, a multiple of the model's ``spatial_multiple``.
        frames: frame count: 1 for images; ``frame_multiple * k + frame_offset`` for video models.
        steps: number of denoising steps; the schedule ``denoise_init`` returns has ``steps + 1`` entries.
        guidance: the value of a guidance-distilled model's guidance input (Flux dev), or None for the plugin's
            default. Classifier-free guidance (``[sample] cfg``) is done by the core and never reaches the plugin.
    """

    width: int
    height: int
    frames: int = 1
    steps: int = 20
    guidance: float | None = None
