"""The diffpipe plugin contract.

Every hook a plugin may implement is declared here. A model plugin is a module registered under the
entry-point group ``diffpipe.models``; the entry-point name is the model name. During a run the core
calls the hooks of the chosen model plugin only (``PluginManager.subset_hook_caller``), so an
implementation never has to ask "is this my model?". Generic plugins (loggers, optimizers, commands)
implement the non-model hooks and see every call.

Hooks marked *model* are called on the selected model plugin only; ``firstresult`` hooks return
the first non-None result.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

from diffpipe_core.types import AudioSpec, EncodeBatch, ModelConfigBase, ModelSpec, SampleRequest, TrainingContext

if TYPE_CHECKING:  # annotations only: the contract is imported by every command, torch only by those using it
    import torch
    from torch import nn

    Tensors = tuple[torch.Tensor, ...]

hookspec = pluggy.HookspecMarker("diffpipe")


# ----------------------------------------------------------------------------------------- model
@hookspec(firstresult=True)
def model_spec() -> ModelSpec:
    """*model* Describe the model: name, image/video, latent geometry, and its ``[model]`` schema.

    Called before anything is loaded (``diffpipe models``, ``diffpipe validate``).
    """


@hookspec(firstresult=True)
def validate_model_files(model_config: ModelConfigBase) -> list[str]:
    """*model* Check the model folder / files' structure without loading any weights.

    Read only what says what the files are (``model_index.json`` and ``config.json`` class names, the
    expected components and weight files, safetensors headers) and return one problem string per finding,
    each naming the folder or file, what was expected and what was found
    (``"/models/x/model_index.json: _class_name is 'StableDiffusionXLPipeline'; expected 'FluxPipeline'"``).
    Return ``[]`` when the files fit. Called by ``diffpipe validate`` and before caching or training starts,
    so a wrong folder is reported before any work is done.
    """


@hookspec(firstresult=True)
def load_encoders(model_config: ModelConfigBase, device: torch.device) -> Any:
    """*model* Load the VAE and text encoders from local files onto ``device``.

    Returns an opaque object that is handed back to :func:`encode_batch`; the core drops it (and
    empties the device cache) before loading the diffusion model. :func:`encode_batch` gets no model config, so
    whatever settings it needs (a token length, a prompt template) travel inside this object: the shared
    ``diffpipe_core.parts.encoders.load_components`` returns an ``Encoders`` holding the components by folder
    name and the ``[model]`` table as ``encoders.config``.
    """


@hookspec(firstresult=True)
def audio_spec(model_config: ModelConfigBase) -> AudioSpec | None:
    """*model* (optional) The sound the model trains on: the sample rate its videos' audio tracks are resampled to,
    the channels, and what an item with a damaged audio stream does (:class:`~diffpipe_core.types.AudioSpec`).

    Not implemented, or None (the default): the model takes no audio; no audio track is read and
    ``EncodeBatch.audio`` stays None. Implemented: every media batch carries ``audio`` and ``audio_present``
    (videos without a track, images and damaged tracks as zeros marked absent), and the cache keys include the spec.
    Read only configs here (e.g. the audio VAE's ``sample_rate``); it is called before caching starts.
    """


@hookspec(firstresult=True)
def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """*model* Encode one batch for the cache; called on every rank for its own shard.

    A media batch (``batch.pixels`` set) returns latents and anything derived from the pixels
    (e.g. ``"latents"``, ``"time_ids"``); a caption batch (``batch.captions`` set) returns text
    tensors (e.g. ``"text_embeds"``, ``"pooled"``, ``"text_mask"``). Every tensor has the batch as
    its first dimension; the core stores each sample's slice. Keys must not start with ``_``. There is no
    ``model_config`` argument: read settings from ``encoders`` (``encoders.config`` for ``load_components``).

    Conditioned models (see ``ModelSpec``) get three more kinds of input, each cached by content like the rest:
    a batch of control images of edit pairs (``batch.control_index`` set: encode them as the target's latents
    are, e.g. ``{"latents": vae(pixels)}``; they reach :func:`prepare_inputs` as ``control_<k>_latents``); the
    first frames of video clips (``batch.first_frames`` beside ``batch.pixels``: return e.g.
    ``"first_frame_latents"`` and image-encoder ``"image_embeds"`` with the clip's ``"latents"``); and, for a
    vision-language text encoder, each caption's control images (``batch.control_pixels``).
    """


@hookspec(firstresult=True)
def load_diffusion_model(model_config: ModelConfigBase, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """*model* Build the diffusion model from local files (a diffusers folder or a single file).

    ``device`` may be ``torch.device("meta")``: the plugin then returns the module skeleton without
    reading weights, and :func:`diffusion_model_weights` tells the core where to find them, so each
    pipeline stage can fill in only its own layers.
    """


@hookspec(firstresult=True)
def diffusion_model_weights(model_config: ModelConfigBase) -> list[tuple[Path, Callable[[str], Any]]]:
    """*model, optional* Where the weights of a meta-built model live, for per-stage loading.

    Returns ``(safetensors_file, key_map)`` pairs; ``key_map`` turns a file key into the model's
    ``state_dict`` key (or None to skip it). When one file tensor makes several model tensors (a fused qkv
    of an original-layout single file) or must be transformed, ``key_map`` returns a list of
    ``(model_key, transform)`` pairs instead, ``transform(file_tensor) -> model_tensor`` (None: as is); a
    stage reads such a tensor only when it needs one of its model keys. Plugins that do not implement it are
    loaded whole.
    """


@hookspec(firstresult=True)
def split_into_layers(model: nn.Module, model_config: ModelConfigBase) -> list[nn.Module]:
    """*model* Cut the diffusion model into an ordered list of pipeline layers.

    Each layer is an ``nn.Module`` whose ``forward`` takes one tuple of tensors and returns one tuple
    of tensors; the first layer receives what :func:`prepare_inputs` returned as inputs. Float
    tensors that cross a layer boundary must be used downstream. The layers must share parameters
    with ``model`` (wrap its submodules; don't copy them) so that adapters and exports see one model.
    """


@hookspec(firstresult=True)
def prepare_inputs(
    batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator
) -> tuple[Tensors, Tensors]:
    """*model* Turn one collated cached micro-batch into ``(model_inputs, loss_targets)``.

    Draw all randomness (noise, timesteps) from ``generator``: the core seeds it per step and
    micro-batch so that the first and last pipeline stages, which both call this hook, agree.
    ``model_inputs`` feed the first layer; ``loss_targets`` reach :func:`compute_loss`.
    Timestep sampling and flow-matching targets are in :mod:`diffpipe_core.diffusion`.

    ``batch`` holds, stacked, every key :func:`encode_batch` returned for the samples' media and captions
    (what it returned for a clip's first frame included). Edit pairs add the tensors of each control image
    ``k`` as ``control_<k>_<key>`` (``diffpipe_core.types.control_key(k, key)``, e.g. ``control_0_latents``
    ``(B, C, h, w)``); a micro-batch holds them for every sample or for none (items without control images are
    batched apart), and all of one micro-batch's control images ``k`` have one size. First-frame conditioning on
    the clip's own latents (LTX-Video's ``first_frame_conditioning_p``) is
    :func:`diffpipe_core.diffusion.first_frame_conditioning`.
    """


@hookspec(firstresult=True)
def compute_loss(outputs: Tensors, targets: Tensors, context: TrainingContext) -> torch.Tensor:
    """*model* Scalar loss from the last layer's outputs and :func:`prepare_inputs`' targets.

    Runs on the last pipeline stage for every micro-batch. ``context`` is the run's :class:`TrainingContext`
    (``context.loss``: run.toml's ``pseudo_huber_c``, ``huber_delta`` or ``smooth_l1_beta``); pass it to
    :func:`diffpipe_core.diffusion.training_loss`, which applies the run's loss. Declaring ``context`` is optional
    (pluggy passes only the arguments an implementation names), but a model whose ``compute_loss`` does not take it
    cannot use those keys: ``diffpipe validate`` refuses them for it.

    With per-folder loss weights, regularisation folders or Differential Output Preservation (the dataset's keys) the
    core calls it on a slice of the micro-batch: every tensor of ``outputs`` and ``targets`` whose first dimension is
    the micro-batch's size is sliced, the others passed as they are; keep per-sample tensors batch-first.
    """


@hookspec(firstresult=True)
def lora_targets(model_config: ModelConfigBase) -> list[str]:
    """*model* The modules to adapt with LoRA: exact module names or dotted suffixes, not regexes.

    peft's rule for a list of ``target_modules``: a module matches ``attn.to_q`` when its full name (as
    ``named_modules`` gives it) is ``attn.to_q`` or ends with ``.attn.to_q``; ``to_q`` matches ``blocks.0.attn.to_q``
    but not ``blocks.0.attn.add_to_q``. Leave out modules whose output nothing reaching the loss reads (the text
    side of an MMDiT's last joint block): their LoRA would get no gradient, and the conformance kit names them.
    The user's ``[adapter] target_modules`` overrides this list.
    """


@hookspec(firstresult=True)
def export_adapter(
    state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str
) -> dict[str, torch.Tensor] | None:
    """*model, optional* Rewrite a peft LoRA state dict (keys relative to the diffusion model, e.g.
    ``blocks.0.attn.to_q.lora_A.weight``) into an ecosystem format.

    ``format`` is ``"diffusers"``, ``"comfyui"``, ``"kohya"`` or a plugin-specific name from
    ``[adapter] save_formats``. Return None for a format the plugin does not know. Without an
    implementation the core writes diffusers/peft keys (``<prefix>.<key>``) and no ``.alpha`` tensors: the
    diffusers file carries alpha (and the rest of the LoRA config) in its safetensors metadata,
    ``lora_adapter_metadata``, as diffusers' ``save_lora_weights`` writes it. Formats ComfyUI reads (kohya,
    ``comfyui``) carry a scalar ``<module>.alpha`` tensor per module instead. The core hands over the adapter with
    the trained strength folded in (``lora_B`` times alpha / rank) and ``alpha`` equal to ``rank``, so every file
    loads at the trained strength in a tool that reads no alpha.
    Called for LoRA only; a LoKr or LoHa is laid out by the core from :func:`adapter_key_names`.
    """


@hookspec(firstresult=True)
def adapter_parts(
    state_dict: dict[str, torch.Tensor], model_config: ModelConfigBase
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]] | None:
    """*model, optional* Split a trained adapter into parts saved each as an adapter of its own (a model that
    trains two networks in one run, such as Wan 2.2 A14B's two experts), or label the one adapter.

    ``state_dict`` is what :func:`export_adapter` gets (keys relative to the diffusion model, strength folded in).
    Return ``{part: (state_dict, labels)}``: each part is written to ``saved/<name>/<part>/`` (``""``: to
    ``saved/<name>/`` itself) as a complete adapter folder, every format of ``[adapter] save_formats`` from its own
    ``state_dict`` (keys relative to the network the part loads into), and ``labels`` (strings) are added to every
    file's safetensors metadata and to its ``adapter_config.json``. A ``diffpipe.part`` label is printed in the
    run's summary beside the part's folder. Default (None): one adapter in ``saved/<name>/``, no labels.
    """


@hookspec(firstresult=True)
def adapter_key_names(modules: list[str], format: str) -> dict[str, str] | None:
    """*model, optional* Where a LoKr or LoHa goes in the ``format`` layout (``[adapter] type = "lokr"``/``"loha"``).

    ``modules`` are the adapted modules' paths in the diffusion model (``transformer_blocks.0.attn.to_q``). Return
    each one's key stem in ``format``, the name ComfyUI (or the format's tool) patches that module's weight under,
    e.g. ``"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"`` (SDXL, kohya) or
    ``"transformer.transformer_blocks.0.attn.to_q"`` (Flux: ComfyUI maps diffusers names into its fused ``qkv``).
    The core writes ``<stem>.lokr_w1`` ... and ``<stem>.alpha`` (:mod:`diffpipe_core.adapter_kinds`); a LoKr or
    LoHa cannot be fused, so a module with no stem of its own in the layout must raise a ValueError naming it.
    Return None for a format the plugin does not write such adapters in. Without an implementation a LoKr/LoHa is
    saved in the ``diffusers`` layout only (the core's, for every model).
    """


@hookspec(firstresult=True)
def original_weight_targets(model_config: ModelConfigBase, keys: list[str]) -> dict[str, list[tuple[str, Any]]] | None:
    """*model, optional* Where weights named in the model's original (native) layout go in the diffusion model: how
    ``[model] merge_adapters`` merges a LoRA file in a native layout (the ComfyUI LoRA of Flux, with BFL names and a
    fused ``qkv``: ``diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight``).

    ``keys`` are original-layout weight keys (``<native module>.weight``, under ``diffusion_model.`` or another
    read prefix, or none). Return, for each key the layout knows, the model tensors it makes as ``[(model tensor
    name, transform)]``: ``transform`` (None: as is) cuts the model tensor out of a tensor shaped like the original
    weight (a fused ``qkv`` makes three, each a slice of rows). Leave out the keys it does not know; None: the model
    has no original layout. Called before anything is loaded. ``DiffusersModel`` answers from its key tables.
    """


@hookspec(firstresult=True)
def parameter_groups(model_config: ModelConfigBase) -> dict[str, list[str]]:
    """*model, optional* Named parameter groups, for per-component learning rates (``[optimizer] group_lr``).

    Maps each group name to regexes matched (``re.match``) against trainable parameter names of the diffusion
    model as ``named_parameters`` gives them (``text_encoder_1\\.``); a parameter matching none joins the first
    group. Called before anything is loaded (``diffpipe validate`` checks ``group_lr`` against it). Default: one
    group, ``"model"``.
    """


@hookspec(firstresult=True)
def group_lr_defaults(model_config: ModelConfigBase) -> dict[str, float]:
    """*model, optional* Learning rates of named parameter groups (:func:`parameter_groups`) that the ``[model]``
    table sets, e.g. Anima's ``llm_adapter_lr`` for its ``llm_adapter`` group (0 freezes it). They join
    ``[optimizer] group_lr`` when the config is read; a rate ``group_lr`` gives for the same group wins. Default
    none."""


@hookspec(firstresult=True)
def adapter_key_prefix() -> str:
    """*model, optional* The prefix of the diffusion model in its diffusers pipeline
    (``"transformer"`` or ``"unet"``); used for the default diffusers-format LoRA. Default
    ``"transformer"``."""


@hookspec(firstresult=True)
def export_model(saved_dir: Path, model_config: ModelConfigBase, out_dir: Path, format: str) -> bool | None:
    """*model, optional* Convert a saved full fine-tune into an ecosystem ``format`` under ``out_dir``.

    ``saved_dir`` holds what the core wrote: ``model-0000k-of-0000n.safetensors`` shards keyed by the
    diffusion model's ``state_dict`` names, one per pipeline stage, plus ``model.safetensors.index.json``.
    Called on rank 0 after every full-model save, once per entry of the run's ``save_model_formats``
    (e.g. ``"diffusers"``, ``"single_file"``). Return True when written, None for an unknown format.
    """


# Sampling (``[sample]`` during training, ``diffpipe sample``): the core runs the loop, classifier-free guidance,
# prompt encoding (``load_encoders`` + ``encode_batch``), the forward passes through the training pipeline, writing
# and logging; a plugin that implements these five hooks can sample (``diffpipe models`` shows it).
@hookspec(firstresult=True)
def denoise_init(
    request: SampleRequest, model_config: ModelConfigBase, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """*model, optional (sampling)* The starting noise and the timestep schedule of one sample.

    Returns ``(latents, schedule)``. ``latents`` has batch size 1 and is drawn from ``generator`` only (the core
    seeds it per prompt, so every sampling point starts from the same noise), in whatever layout
    :func:`denoise_inputs` and :func:`denoise_step` carry, e.g. Flux ``(1, C, H/8, W/8)``.
    ``schedule`` is a 1-D tensor of ``request.steps + 1`` entries from the noisiest to the last, e.g.
    flow-matching sigmas ``1 ... 0`` (:func:`diffpipe_core.sampling.schedules.flow_sigmas`).
    """


@hookspec(firstresult=True)
def denoise_inputs(
    latents: torch.Tensor,
    schedule: torch.Tensor,
    index: int,
    text: dict[str, torch.Tensor],
    request: SampleRequest,
    model_config: ModelConfigBase,
) -> Tensors:
    """*model, optional (sampling)* The first pipeline layer's inputs for denoising step ``index``.

    The same tuple layout :func:`prepare_inputs` returns as ``model_inputs``, built from the current
    ``latents`` at ``schedule[index]`` and the prompt's ``text`` tensors (what :func:`encode_batch` returned for a
    caption). Both have the same batch size: 1, or 2 under classifier-free guidance (negative prompt first).
    """


@hookspec(firstresult=True)
def denoise_step(
    latents: torch.Tensor, prediction: torch.Tensor, schedule: torch.Tensor, index: int, model_config: ModelConfigBase
) -> torch.Tensor:
    """*model, optional (sampling)* One step of the sampler: from ``schedule[index]`` to ``schedule[index + 1]``.

    ``prediction`` is the first tensor the last pipeline layer returned (float32, already combined by the core's
    classifier-free guidance or by :func:`combine_guidance`), for ``latents`` of batch size 1. Returns the next
    latents in the same layout.
    Flow-matching models take an Euler step (:func:`diffpipe_core.sampling.schedules.flow_euler_step`); others
    follow their reference pipeline's scheduler.
    """


@hookspec(firstresult=True)
def combine_guidance(
    uncond: torch.Tensor,
    cond: torch.Tensor,
    scale: float,
    schedule: torch.Tensor,
    index: int,
    model_config: ModelConfigBase,
) -> torch.Tensor:
    """*model, optional (sampling)* Combine the negative and the positive prediction of classifier-free guidance.

    For a model whose pipeline does more than the plain combination under ``[sample] cfg > 1``. ``uncond`` and
    ``cond`` are the two halves (batch 1 each, float32) of the first tensor the last pipeline layer returned, in
    that layer's layout (packed tokens for a transformer that packs them); ``scale`` is ``cfg`` and
    ``schedule[index]`` the current step. Returns the prediction :func:`denoise_step` gets. Without an
    implementation the core computes ``uncond + scale * (cond - uncond)``. Qwen-Image's ``true_cfg_scale``, for
    example, rescales that to the norm of ``cond`` over the last dimension:

        combined = uncond + scale * (cond - uncond)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    """


@hookspec(firstresult=True)
def load_unconditional_model(model_config: ModelConfigBase, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """*model, optional (sampling, with ModelSpec.unconditional_model)* Load the frozen model of the unconditional
    branch.

    ``ModelSpec.unconditional_model`` names it; return it whole, on ``device`` in ``dtype``, or on ``meta`` its
    skeleton only (the stage plan counts its bytes). Called only when ``[sample] cfg > 1``, once per run, on the last
    stage of each pipeline, with the host as its device (the core moves it onto the accelerator only while
    sampling). The core cuts it with :func:`split_into_layers` and runs them in order, so it must be the trained
    model's class (or one those layers accept). :class:`~diffpipe_core.parts.plugin.DiffusersModel` implements it:
    the folder's component of that name, or the file ``[model] unconditional_model`` names (as ``diffusion_model`` is
    read: any layout, kept quantized). Bad or missing files raise, naming the file or the key to set.
    """


@hookspec(firstresult=True)
def unconditional_inputs(
    latents: torch.Tensor,
    schedule: torch.Tensor,
    index: int,
    request: SampleRequest,
    model_config: ModelConfigBase,
) -> Tensors:
    """*model, optional (sampling, with ModelSpec.unconditional_model)* The unconditional model's first-layer inputs
    for denoising step ``index``.

    Batch 1, at ``schedule[index]``: what the model's pipeline feeds its unconditional branch (Ideogram 4: the image
    tokens alone, no text). No negative prompt is encoded for such a model. Its first output tensor is the ``uncond``
    that :func:`combine_guidance` (or ``uncond + scale * (cond - uncond)``) gets.
    """


@hookspec(firstresult=True)
def load_decoder(model_config: ModelConfigBase, device: torch.device) -> Any:
    """*model, optional (sampling)* Load only what turns latents into pixels (the VAE) onto ``device``.

    Called once per run, on the rank that decodes (rank 0), with ``device`` the host (``cpu``) when the run has
    an accelerator: the core keeps the object in host memory and moves the ``nn.Module`` s it finds in it (the
    object itself, or inside a tuple, list, dict or its attributes) onto the accelerator only while
    :func:`decode_latents` runs, so it is never on the accelerator while training. Tensors outside those modules
    stay in host memory: move them in :func:`decode_latents`. An object holding no module is loaded onto the
    accelerator at each sampling point and dropped right after decoding.
    """


@hookspec(firstresult=True)
def decode_latents(decoder: Any, latents: torch.Tensor) -> torch.Tensor:
    """*model, optional (sampling)* Decode final latents (what :func:`denoise_step` returned, batch first) to pixels.

    Returns float RGB in [-1, 1]: ``(B, 3, H, W)`` for images, ``(B, 3, F, H, W)`` for videos. Undo the latent
    scaling/shift the plugin applied in :func:`encode_batch`.
    """


# ---------------------------------------------------------------------------------------- generic
@hookspec(firstresult=True)
def decode_audio(decoder: Any, latents: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """*model* (optional) The sound of a sample from its final latents (as :func:`decode_latents` gets them):
    ``(waveform, sample_rate)``, the waveform ``(B, channels, S)`` float in [-1, 1] (1 or 2 channels), e.g. the audio
    VAE and vocoder of an audio-video model. The core muxes it into the sample's MP4 (AAC) and logs it where the
    loggers take audio (TensorBoard's ``add_audio``, W&B). Not implemented, or None: the MP4 is silent.
    """


@hookspec
def register_commands(cli: Any) -> None:
    """Add click commands to the ``diffpipe`` CLI group."""


@hookspec
def register_optimizers(register: Callable[[str, Callable[..., torch.optim.Optimizer]], None]) -> None:
    """Offer optimizers by name: ``register("lion", lambda params, **kw: Lion(params, **kw))``. A family of names,
    ``register("lib.*", lookup)``, offers ``[optimizer] type = "lib.<Name>"`` for any name: ``lookup(name)`` returns
    its factory or raises a ValueError saying which names are valid (imported only when a config names one)."""


@hookspec
def on_train_step_end(step: int, metrics: dict[str, float]) -> None:
    """Observe the metrics of a finished optimizer step (rank 0 only)."""


@hookspec
def on_train_end(run_dir: Path, summary: dict[str, Any]) -> None:
    """Observe the end of a training run (rank 0 only)."""
