"""What each key of a tdrussell/diffusion-pipe config becomes in diffpipe.

One table serves both ``diffpipe import-config`` (which writes the changes) and ``diffpipe validate`` (which
names the diffpipe key when it meets an anchor key, instead of guessing a spelling). A rule takes the anchor key,
its value and a :class:`Context` (which diffpipe keys exist, the rest of the anchor config) and returns the
:class:`Change` list: where the value goes in diffpipe, or that it has no equivalent, and why.

Sections: ``run`` (run.toml's top level), ``model``, ``adapter``, ``optimizer``, ``dataset`` (the dataset
TOML's top level) and ``directory`` (one ``[[directory]]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffpipe_core.anchor.models import ANCHOR_DEFAULTS

RUN_FILE_SECTIONS = ("run", "model", "adapter", "optimizer", "logging")
FLOAT8 = ("float8", "float8_e4m3fn", "float8_e5m2")
SECRET_WORDS = ("key", "token", "password", "secret")


@dataclass(frozen=True)
class Change:
    """What becomes of one anchor key: ``section.key = value`` in diffpipe, or (``section`` None) nothing.

    ``why`` says what differs (empty when the key carries over as is); ``is_path`` marks a path the importer
    resolves against where diffusion-pipe ran; ``needs_input`` marks a value diffpipe needs and the anchor
    config does not give (written as a TODO)."""

    section: str | None
    key: str | None = None
    value: Any = None
    why: str = ""
    is_path: bool = False
    needs_input: bool = False

    @property
    def carried(self) -> bool:
        return self.section is not None and self.key is not None


@dataclass
class Context:
    """The keys diffpipe has per section (None: unknown, assume present), the anchor's whole run config and the
    anchor table being converted (a ``[[directory]]`` entry merged over its dataset's top level)."""

    fields: dict[str, set[str] | None] = field(default_factory=dict)
    anchor: dict[str, Any] = field(default_factory=dict)
    table: dict[str, Any] = field(default_factory=dict)
    model_label: str = "this model"

    def has(self, section: str, key: str) -> bool:
        if section not in self.fields:
            self.fields[section] = core_fields(section)
        known = self.fields[section]
        return known is None or key in known

    def knows(self, section: str, key: str) -> bool:
        """Whether ``section`` surely has ``key`` (its keys are known: the model table's once its plugin is)."""
        return self.has(section, key) and self.fields[section] is not None


def core_fields(section: str) -> set[str] | None:
    """The keys of the core's own schemas (the model table's come from its plugin: None here)."""
    from diffpipe_core.config import AdapterConfig, OptimizerConfig, RunConfig
    from diffpipe_core.data.dataset_config import DatasetConfig, DirectoryConfig

    schema = {
        "run": RunConfig,
        "adapter": AdapterConfig,
        "optimizer": OptimizerConfig,
        "dataset": DatasetConfig,
        "directory": DirectoryConfig,
    }.get(section)
    return set(schema.model_fields) if schema is not None else None


Rule = Callable[[str, Any, Context], list[Change]]


def _none(why: str) -> Rule:
    return lambda key, value, ctx: [Change(None, why=why)]


def _same(section: str, why: str = "", is_path: bool = False) -> Rule:
    def rule(key: str, value: Any, ctx: Context) -> list[Change]:
        if ctx.has(section, key):
            return [Change(section, key, value, why, is_path)]
        return [Change(None, why=f"{_label(section, ctx)} has no {key}")]

    return rule


def _rename(section: str, to: str, why: str = "", missing: str = "", is_path: bool = False) -> Rule:
    def rule(key: str, value: Any, ctx: Context) -> list[Change]:
        if ctx.has(section, to):
            return [Change(section, to, value, why, is_path)]
        return [Change(None, why=missing or f"{_label(section, ctx)} has no {to} ({key})")]

    return rule


def _label(section: str, ctx: Context) -> str:
    return {"model": ctx.model_label, "run": "run.toml", "dataset": "the dataset TOML"}.get(section, f"[{section}]")


# ------------------------------------------------------------------------------------------- run.toml top level
def _every_n_examples(to: str) -> Rule:
    def rule(key: str, value: Any, ctx: Context) -> list[Change]:
        mbs = ctx.anchor.get("micro_batch_size_per_gpu", 1)
        if isinstance(mbs, list):
            mbs = mbs[0][1] if mbs and isinstance(mbs[0], list) else 1
        per_step = int(mbs) * int(ctx.anchor.get("gradient_accumulation_steps", 1))
        try:
            steps = max(1, int(value) // per_step)
        except (TypeError, ValueError):
            return [Change(None, why=f"diffpipe counts steps ({to}), not examples")]
        return [
            Change(
                "run",
                to,
                steps,
                f"{key} = {value} divided by the samples per step ({per_step} = micro_batch_size_per_gpu x "
                "gradient_accumulation_steps on one data-parallel rank; divide again by the ranks you train on)",
            )
        ]

    return rule


def _activation_checkpointing(key: str, value: Any, ctx: Context) -> list[Change]:
    if value == "unsloth":
        return [
            Change(
                "run",
                key,
                "offload",
                "it keeps each checkpointed block's input in CPU memory until backward, as 'offload' does",
            )
        ]
    return [Change("run", key, value)]


def _partition_method(key: str, value: Any, ctx: Context) -> list[Change]:
    if value in ("parameters", "uniform"):
        return [Change("run", key, value)]
    if value == "manual":
        return [Change(None, why="diffpipe uses partition_split whenever it is set; no method to name")]
    return [Change(None, why=f"diffpipe partitions by 'parameters' or 'uniform' (or partition_split), not {value!r}")]


def _monitoring(key: str, value: Any, ctx: Context) -> list[Change]:
    """diffusion-pipe's ``[monitoring]`` (enable_wandb, wandb_api_key, wandb_tracker_name, wandb_run_name):
    diffpipe's ``[logging] wandb`` table. The API key is never carried: W&B reads WANDB_API_KEY or its login."""
    if not isinstance(value, dict) or not value.get("enable_wandb"):
        return [Change(None, why="W&B was off; diffpipe's W&B logging is [logging] wandb = { project = ... }")]
    wandb: dict[str, Any] = {}
    if value.get("wandb_tracker_name"):
        wandb["project"] = value["wandb_tracker_name"]
    if value.get("wandb_run_name"):
        wandb["name"] = value["wandb_run_name"]
    why = "W&B's project from wandb_tracker_name, its run name from wandb_run_name"
    if value.get("wandb_api_key"):
        why += "; the API key is not copied: `wandb login` or WANDB_API_KEY gives it"
    if "project" not in wandb:
        return [Change("logging", "wandb", wandb or None, why + "; give the W&B project", needs_input=True)]
    return [Change("logging", "wandb", wandb, why)]


def _moved_to_dataset(to: str = "") -> Rule:
    def rule(key: str, value: Any, ctx: Context) -> list[Change]:
        target = to or key
        return [Change("dataset", target, value)]

    return rule


RUN_RULES: dict[str, Rule] = {
    "output_dir": _same("run", is_path=True),
    "epochs": _same("run"),
    "max_steps": _same("run"),
    "micro_batch_size_per_gpu": _same("run"),
    "image_micro_batch_size_per_gpu": _same("run"),
    "pipeline_stages": _same("run"),
    "gradient_accumulation_steps": _same("run"),
    "gradient_clipping": _same("run"),
    "warmup_steps": _same("run"),
    "lr_scheduler": _same("run"),
    "blocks_to_swap": _same("run"),
    "pseudo_huber_c": _same("run"),
    "huber_delta": _same("run"),
    "smooth_l1_beta": _same("run"),
    "eval_every_n_epochs": _same("run"),
    "eval_every_n_steps": _same("run"),
    "eval_before_first_step": _same("run"),
    "save_every_n_epochs": _same("run"),
    "save_every_n_steps": _same("run"),
    "checkpoint_every_n_epochs": _same("run"),
    "checkpoint_every_n_minutes": _same("run"),
    "partition_split": _same("run"),
    "save_dtype": _same("run"),
    "caching_batch_size": _same("run"),
    "compile": _same("run"),
    "activation_checkpointing": _activation_checkpointing,
    "partition_method": _partition_method,
    "eval_every_n_examples": _every_n_examples("eval_every_n_steps"),
    "save_every_n_examples": _every_n_examples("save_every_n_steps"),
    "logging_steps": _rename("run", "log_every_n_steps"),
    "video_clip_mode": _moved_to_dataset(),
    "uncond_fraction": _moved_to_dataset(),
    "steps_per_print": _none(
        "it is DeepSpeed's console log interval; diffpipe shows a progress bar instead, and log_every_n_steps "
        "sets the TensorBoard interval"
    ),
    "force_constant_lr": _same("optimizer"),
    "reentrant_activation_checkpointing": _none(
        "diffpipe's activation checkpointing is always non-reentrant, which works with any number of stages"
    ),
    "map_num_proc": _none(
        "diffpipe's scan reads new and changed files on every core (unchanged ones are not read again), and the "
        "training processes encode the cache together, caching_batch_size at a time"
    ),
    "x_axis_examples": _none("diffpipe's logs are by step; metrics.jsonl has the epoch of every step"),
    "eval_micro_batch_size_per_gpu": _none("diffpipe evaluates with micro_batch_size_per_gpu"),
    "image_eval_micro_batch_size_per_gpu": _none("diffpipe evaluates with micro_batch_size_per_gpu"),
    "eval_gradient_accumulation_steps": _none("diffpipe evaluates every eval micro-batch in one pass"),
    "disable_block_swap_for_eval": _none("diffpipe swaps the same blocks in eval as in training"),
    "resume_from_checkpoint": _none("resume with `diffpipe train --resume` (latest, a run folder or a checkpoint)"),
    "regenerate_cache": _none("use `diffpipe train --regenerate-cache` (the cache is rebuilt when inputs change)"),
    "monitoring": _monitoring,
}


# --------------------------------------------------------------------------------------------------- [model]
def _transformer_dtype(key: str, value: Any, ctx: Context) -> list[Change]:
    if value == "float8_e5m2":
        why = "float8_e5m2 storage of the frozen base weights with a per-tensor scale, computed in dtype; LoRA only"
        return [Change("model", "quantize", "float8_e5m2", why)]
    if value in FLOAT8:
        why = "float8_e4m3 storage of the frozen base weights with a per-tensor scale, computed in dtype; LoRA only"
        return [Change("model", "quantize", "float8", why)]
    if value in ("nf4", "int8"):
        return [Change("model", "quantize", value, "quantized frozen base weights; LoRA only")]
    return [Change("model", "dtype", value, "diffpipe's dtype is the diffusion model's; the encoders have their own")]


def _model_dtype(key: str, value: Any, ctx: Context) -> list[Change]:
    model = ctx.anchor.get("model", {}) if isinstance(ctx.anchor.get("model"), dict) else {}
    if model.get("transformer_dtype", model.get("diffusion_model_dtype")) not in (None, *FLOAT8, "nf4", "int8"):
        return [Change(None, why="transformer_dtype sets diffpipe's dtype (the diffusion model's)")]
    return [Change("model", "dtype", value)]


_FROM_PATH = "diffpipe reads the VAE and text encoders from path, a diffusers folder of the model"


def _path_needed(key: str, value: Any, ctx: Context) -> list[Change]:
    return [Change(None, why=_FROM_PATH)]


#: diffusion-pipe's keys of text encoder files (and ComfyUI's text_encoders list), in the order they are listed
TEXT_ENCODER_KEYS = (
    "text_encoders", "text_encoder", "text_encoder_path", "clip_path", "t5_path", "llm_path", "llama3_path", "byt5_path"
)  # fmt: skip
WEIGHT_FILE_SUFFIXES = (".safetensors", ".sft", ".gguf")


def _is_weight_file(value: Any) -> bool:
    """A component given as one weight file (diffpipe's component-file keys take it): a file, or where it is not
    here, a weight file's name; a folder is read through path."""
    if not isinstance(value, str):
        return False
    where = Path(value).expanduser()
    return where.is_file() or (not where.is_dir() and value.endswith(WEIGHT_FILE_SUFFIXES))


def _component_file(to: str, key: str, value: Any, ctx: Context) -> list[Change]:
    """``vae`` / ``vae_path`` / ``audio_vae``: a single file becomes diffpipe's component file key."""
    if _is_weight_file(value) and ctx.has("model", to):
        return [Change("model", to, value, "" if key == to else "the component as one file", is_path=True)]
    return [Change(None, why=_FROM_PATH)]


def _file_entries(value: Any) -> list[Any]:
    """The weight-file entries of a text encoder key's value (a path, a ``{path, type}`` table, or a list of them;
    a ``{paths = [...], type}`` table, one ComfyUI loader of several files, becomes one entry per file)."""
    entries = value if isinstance(value, list) else [] if value is None else [value]
    flat: list[Any] = []
    for e in entries:
        if isinstance(e, dict) and isinstance(e.get("paths"), list):
            flat += [{"path": p, "type": e["type"]} if "type" in e else p for p in e["paths"]]
        else:
            flat.append(e)
    return [e for e in flat if _is_weight_file(e.get("path") if isinstance(e, dict) else e)]


def _text_encoder_files(key: str, ctx: Context) -> list[Change]:
    """Every text encoder file the anchor's ``[model]`` names (``text_encoders`` entries, ``t5_path``, ``llm_path``,
    ...) becomes one ``text_encoders`` list, written at the first of those keys; which of the model's text encoders
    each file holds is read from its tensors. A folder (an LLM's transformers folder) comes from path."""
    model = ctx.anchor.get("model", {}) if isinstance(ctx.anchor.get("model"), dict) else {}
    found = {name: _file_entries(model.get(name)) for name in TEXT_ENCODER_KEYS}
    if not found[key] or not ctx.has("model", "text_encoders"):
        return [Change(None, why=_FROM_PATH)]
    first = next(n for n in TEXT_ENCODER_KEYS if found[n])
    if key != first:
        return [Change(None, why=f"as a key: its file is in text_encoders, written at {first}")]
    files = [e for n in TEXT_ENCODER_KEYS for e in found[n]]
    why = "" if files == model.get("text_encoders") else (
        "every text encoder file, one entry each (which of the model's encoders a file holds is read from its tensors)"
    )
    return [Change("model", "text_encoders", files, why)]


# the anchor's learning rates per part of each block (Cosmos-Predict2, Anima), as name patterns over diffpipe's
# (diffusers') module names: self_attn = attn1, cross_attn = attn2, mlp = ff, adaln_modulation = normK.linear_J
BLOCK_PART_LRS = {"self_attn_lr": "*.attn1.*", "cross_attn_lr": "*.attn2.*", "mlp_lr": "*.ff.*",
                  "mod_lr": "*.norm*.linear_*"}


MODEL_RULES: dict[str, Rule] = {
    "dtype": _model_dtype,
    "transformer_dtype": _transformer_dtype,
    "diffusion_model_dtype": _transformer_dtype,
    "diffusers_path": _rename("model", "path", is_path=True),
    "transformer_path": _rename(
        "model",
        "diffusion_model",
        "a single-file transformer in the original key layout",
        missing="this model's plugin reads the transformer from path",
        is_path=True,
    ),
    "single_file_path": _rename(
        "model",
        "diffusion_model",
        "its transformer replaces path/transformer; the VAE and T5 still come from path",
        is_path=True,
    ),
    "checkpoint_path": lambda key, value, ctx: _checkpoint_path(key, value, ctx),
    "debiased_estimation_loss": _rename("model", "debiased_estimation"),
    "max_sequence_length": _rename("model", "text_max_length", "the text encoder's tokens per caption"),
    "max_llama3_sequence_length": _rename(
        "model", "text_max_length", "tokens per caption (HiDream: one length for all four encoders, as its pipeline)"
    ),
    "llama3_4bit": _rename("model", "llama_4bit", "Llama loaded in 4 bits (bitsandbytes nf4) while caching"),
    "ckpt_path": _path_needed,
    "vae_path": lambda key, value, ctx: _component_file("vae", key, value, ctx),
    "vae": lambda key, value, ctx: _component_file("vae", key, value, ctx),
    "audio_vae": lambda key, value, ctx: _component_file("audio_vae", key, value, ctx),
    **{key: lambda key, value, ctx: _text_encoder_files(key, ctx) for key in TEXT_ENCODER_KEYS},
    "cache_text_embeddings": _none("diffpipe always caches the text embeddings"),
    "bypass_guidance_embedding": _none("diffpipe always feeds the guidance input (model.guidance sets its value)"),
    "unet_lr": lambda key, value, ctx: _group_lr("unet", value, ctx),
    "text_encoder_1_lr": lambda key, value, ctx: _group_lr("text_encoder_1", value, ctx),
    "text_encoder_2_lr": lambda key, value, ctx: _group_lr("text_encoder_2", value, ctx),
    **{key: lambda key, value, ctx: _pattern_lr(key, value) for key in BLOCK_PART_LRS},
    "llm_adapter_lr": _same("model", "the LLM adapter's rate (its parameter group's group_lr; 0 freezes it)"),
    "freeze_llm_adapter": lambda key, value, ctx: _freeze_llm_adapter(value, ctx),
    "flux_shift": lambda key, value, ctx: _flux_shift(value, ctx),
    "image_shift": lambda key, value, ctx: _image_shift(key, value, ctx),
}

def _checkpoint_path(key: str, value: Any, ctx: Context) -> list[Change]:
    """SDXL's single-file checkpoint: diffpipe's path, with the component configs and tokenizers from a diffusers
    SDXL folder (config_path), which diffusion-pipe takes from the library's defaults."""
    changes = _rename("model", "path", "path takes a single-file checkpoint too", is_path=True)(key, value, ctx)
    if changes[0].carried and ctx.knows("model", "config_path"):
        why = ("a diffusers SDXL folder for the component configs and tokenizers (e.g. "
               "stabilityai/stable-diffusion-xl-base-1.0 without its weights)")
        changes.append(Change("model", "config_path", None, why, needs_input=True))
    return changes


SDXL_TEXT_ENCODERS = ANCHOR_DEFAULTS["sdxl"]["train_text_encoders"][1]


def _flux_shift(value: Any, ctx: Context) -> list[Change]:
    """diffusion-pipe shifts by ``shift`` when it is set and only otherwise by ``flux_shift``; diffpipe refuses both
    at once, so a set ``shift`` turns ``flux_shift`` off."""
    model = ctx.anchor.get("model", {}) if isinstance(ctx.anchor.get("model"), dict) else {}
    if value and model.get("shift") and ctx.has("model", "flux_shift"):
        return [Change("model", "flux_shift", False, "diffusion-pipe ignores flux_shift when shift is set")]
    return _same("model")("flux_shift", value, ctx)


def _image_shift(key: str, value: Any, ctx: Context) -> list[Change]:
    """diffusion-pipe's ``image_shift``: the shift of one-frame items (MiniMax H3); carried where the model has the
    key, else named: diffpipe shifts an image's times by ``shift``, as a clip's."""
    if ctx.has("model", key):
        return [Change("model", key, value)]
    return [Change(None, why=f"{ctx.model_label} shifts an image's training times by shift, as a clip's")]


def _pattern_lr(key: str, value: Any) -> list[Change]:
    """diffusion-pipe's ``[model] self_attn_lr`` etc.: ``[optimizer] group_lr`` with the name pattern of those
    modules in the diffusers model."""
    pattern = BLOCK_PART_LRS[key]
    return [Change("optimizer", "group_lr", {pattern: value},
                   f"the learning rate of the parameters named {pattern} (diffusers' name for that part)")]


def _freeze_llm_adapter(value: Any, ctx: Context) -> list[Change]:
    """diffusion-pipe's Anima ``freeze_llm_adapter = true``: ``[model] llm_adapter_lr = 0`` (diffpipe's default)."""
    if not ctx.has("model", "llm_adapter_lr"):
        return [Change(None, why=f"{ctx.model_label} has no LLM adapter")]
    if value and not ctx.anchor.get("model", {}).get("llm_adapter_lr"):
        return [Change("model", "llm_adapter_lr", 0.0, "the LLM adapter frozen")]
    return [Change(None, why="llm_adapter_lr says whether the LLM adapter trains")]


def _group_lr(group: str, value: Any, ctx: Context) -> list[Change]:
    """diffusion-pipe's SDXL learning rates per part: diffpipe's ``[optimizer] group_lr``, with the text encoders
    trained (``[model] train_text_encoders``) as diffusion-pipe trains them."""
    if not ctx.knows("model", "train_text_encoders"):
        return [Change(None, why=f"{ctx.model_label} trains its diffusion model at [optimizer] lr")]
    changes = [Change("optimizer", "group_lr", {group: value}, "diffpipe's learning rates per part")]
    if group != "unet":
        changes.append(Change("model", "train_text_encoders", True, SDXL_TEXT_ENCODERS))
    return changes


# ------------------------------------------------------------------------------------------ [adapter], [optimizer]
def _adapter_type(key: str, value: Any, ctx: Context) -> list[Change]:
    from diffpipe_core.config import AdapterConfig

    known = literal_values(AdapterConfig.model_fields["type"].annotation)
    if known is None or value in known:
        return [Change("adapter", key, value)]
    offer = ", ".join(repr(k) for k in known)
    return [Change("adapter", key, value, f"diffpipe has no {value!r} adapter; it offers {offer}", needs_input=True)]


def _init_from_existing(key: str, value: Any, ctx: Context) -> list[Change]:
    why = (
        "diffpipe reads the LoRA tensors of a saved adapter folder or adapter_model.safetensors; a diffusion-pipe "
        "LoRA whose keys do not match this model's layers is refused at the start of training"
    )
    return [Change("adapter", key, value, why, is_path=True)]


ADAPTER_RULES: dict[str, Rule] = {
    "type": _adapter_type,
    "rank": _same("adapter"),
    "alpha": _same("adapter"),
    "dropout": _same("adapter"),
    "dtype": _same("adapter"),
    "init_from_existing": _init_from_existing,
    "decompose_factor": _rename("adapter", "factor", "LoKr's Kronecker factor"),
    "rank_dropout": _same("adapter"),
    "fuse_adapters": _none("diffpipe does not merge other LoRAs into the base before training"),
}

OPTIMIZER_NAMES = {
    "adamw": "adamw",
    "adamw_optimi": "adamw_optimi",
    "stableadamw": "stableadamw",
    "automagic": "automagic",
    "adamw8bit": "adamw8bit",
    "adamw8bitkahan": "adamw8bit_kahan",
    "adamw8bit_kahan": "adamw8bit_kahan",
    "sgd": "sgd",
}
PLUGIN = "the diffpipe-optimizers plugin (pip install diffpipe-optimizers)"


def _optimizer_type(key: str, value: Any, ctx: Context) -> list[Change]:
    name = str(value)
    registered = _registered_optimizers()
    mapped = OPTIMIZER_NAMES.get(name.lower())
    if mapped is not None:
        missing = registered is not None and mapped not in registered
        why = f"{mapped!r} comes with {PLUGIN}" if missing else ""
        return [Change("optimizer", key, mapped, why, needs_input=missing)]
    for candidate in (name, name.lower()):
        if registered is None or candidate in registered:
            return [Change("optimizer", key, candidate)]
    if registered is not None and "pytorch_optimizer.*" in registered:
        why = "diffusion-pipe loads an optimizer it does not name itself from pytorch-optimizer by class name"
        return [Change("optimizer", key, f"pytorch_optimizer.{name}", why)]
    offer = ", ".join(repr(n) for n in sorted(registered or ()))
    why = f"no optimizer {name!r} is installed in diffpipe; it has {offer} (plugins register more)"
    return [Change("optimizer", key, name, why, needs_input=True)]


def _gradient_release(key: str, value: Any, ctx: Context) -> list[Change]:
    """diffusion-pipe's ``gradient_release`` is diffpipe's: a full fine-tune at gradient_accumulation_steps 1."""
    if not value:
        return [Change(None, why="off, as diffpipe's default")]
    if "adapter" in ctx.anchor:
        return [Change(None, why="diffpipe releases gradients of full fine-tunes only; an adapter's are small")]
    gas = ctx.anchor.get("gradient_accumulation_steps", 1)
    if gas != 1:
        return [Change(None, why=f"needs gradient_accumulation_steps = 1 (this config has {gas}), as in "
                                 "diffusion-pipe")]
    return [Change("optimizer", key, True, "full fine-tunes at gradient_accumulation_steps = 1; gradient_clipping "
                                           "clips each parameter by its own norm")]


def _registered_optimizers() -> set[str] | None:
    try:
        from diffpipe_core.optim import available_optimizers
        from diffpipe_core.registry import get_registry

        return set(available_optimizers(get_registry().pm))
    except Exception:  # the plugins could not be loaded: do not guess
        return None


OPTIMIZER_RULES: dict[str, Rule] = {
    "type": _optimizer_type,
    "lr": _same("optimizer"),
    "betas": _same("optimizer"),
    "weight_decay": _same("optimizer"),
    "eps": _same("optimizer"),
    "gradient_release": _gradient_release,
    "stabilize": _none("diffpipe's adamw8bit_kahan has no stabilize option"),
}


# ------------------------------------------------------------------------------------------------- dataset TOML
def _cache_shuffle_num(section: str) -> Rule:
    def rule(key: str, value: Any, ctx: Context) -> list[Change]:
        if not isinstance(value, int) or value <= 0:
            if ctx.table.get("shuffle_tags"):
                return [Change(None, why="with shuffle_tags, diffusion-pipe caches one shuffled caption for 0")]
            return [Change(None, why="0 keeps the captions as they are, diffpipe's default")]
        return [
            Change(section, "shuffle_tags", True, "diffusion-pipe shuffles tags whenever cache_shuffle_num > 0"),
            Change(section, key, value),
        ]

    return rule


def _skip_empty_caption(section: str) -> Rule:
    def rule(key: str, value: Any, ctx: Context) -> list[Change]:
        if value is False:
            return [Change(section, "allow_empty_captions", True, "the inverse: keep items without a caption")]
        return [Change(None, why="skipping items without a caption is diffpipe's default (allow_empty_captions)")]

    return rule


def _shuffle_tags(section: str) -> Rule:
    def rule(key: str, value: Any, ctx: Context) -> list[Change]:
        shuffle_num = ctx.table.get("cache_shuffle_num")
        if isinstance(shuffle_num, int) and shuffle_num > 0:
            return [Change(section, key, True, "" if value else "diffusion-pipe shuffles when cache_shuffle_num > 0")]
        if value:
            why = "diffusion-pipe caches one shuffled caption when cache_shuffle_num is not set"
            return [Change(section, key, value), Change(section, "cache_shuffle_num", 1, why)]
        return [Change(section, key, value)]

    return rule


def _dataset_rules(section: str) -> dict[str, Rule]:
    rules: dict[str, Rule] = {
        key: _same(section)
        for key in (
            "resolutions",
            "enable_ar_bucket",
            "min_ar",
            "max_ar",
            "num_ar_buckets",
            "ar_buckets",
            "frame_buckets",
            "caption_prefix",
            "video_clip_mode",
        )
    }
    rules.update(
        {
            "cache_shuffle_num": _cache_shuffle_num(section),
            "cache_shuffle_delimiter": _rename(section, "tag_delimiter"),
            "skip_empty_caption": _skip_empty_caption(section),
            "shuffle_tags": _shuffle_tags(section),
            "size_buckets": _same(section),
            "shuffle_metadata": _none(
                "diffpipe's data order does not depend on the file order: it reshuffles every epoch from [run] seed"
            ),
            "online_captions": _none(
                "diffpipe caches the text embeddings of every caption (captions.json's lists too) before training"
            ),
        }
    )
    return rules


DATASET_RULES = _dataset_rules("dataset")
DATASET_RULES["num_repeats"] = lambda key, value, ctx: [
    Change("directory", key, value, "the default of every [[directory]] that sets none")
]
DATASET_RULES["subsample_ratio"] = _same("dataset")
_PER_DIRECTORY = "diffusion-pipe reads it per [[directory]] only: at the top level it had no effect"
DATASET_RULES["control_path"] = _none(_PER_DIRECTORY)
DATASET_RULES["default_mask_file"] = _none(_PER_DIRECTORY)
DIRECTORY_RULES = _dataset_rules("directory")
DIRECTORY_RULES.update(
    {
        "path": _same("directory", is_path=True),
        "mask_path": _same("directory", is_path=True),
        "default_mask_file": _same("directory", is_path=True),
        "control_path": _same("directory", is_path=True),
        "num_repeats": _same("directory"),
        "subsample_ratio": _none("diffusion-pipe reads it from the dataset's top level only: here it had no effect"),
    }
)

RULES: dict[str, dict[str, Rule]] = {
    "run": RUN_RULES,
    "model": MODEL_RULES,
    "adapter": ADAPTER_RULES,
    "optimizer": OPTIMIZER_RULES,
    "dataset": DATASET_RULES,
    "directory": DIRECTORY_RULES,
}


def changes_for(section: str, key: str, value: Any, ctx: Context) -> list[Change]:
    """What the anchor's ``key = value`` in ``section`` becomes; a key without a rule carries over under its own
    name when diffpipe has it."""
    rule = RULES[section].get(key)
    if rule is None:
        rule = _same(section)
    return rule(key, value, ctx)


# ---------------------------------------------------------------------------------------- hints for validate
def _hint(section: str, key: str, value: Any, valid: list[str], file: str) -> str | None:
    if key not in RULES[section]:
        return None
    ctx = Context(fields={section: set(valid)})
    changes = changes_for(section, key, value, ctx)
    if all(c.section == section and c.key == key and c.value == value for c in changes):
        return None  # the same key and value in diffpipe: the problem is something else
    shown = _anchor_text(key, value)
    if key in valid:
        lead = f"{shown} is diffusion-pipe's value"
    elif shown != "the" and any(c.carried and c.value != value for c in changes):
        lead = f"diffusion-pipe's {key} = {shown}"
    else:
        lead = "diffusion-pipe's key"
    parts = []
    for c in changes:
        why = f" ({c.why})" if c.why else ""
        if not c.carried:
            parts.append(f"{lead} with no diffpipe equivalent: {c.why}. Remove it")
            continue
        shown = "<your choice>" if c.needs_input else toml_value(c.value)
        if c.section == "directory" and section != "directory":
            parts.append(f"{lead}; diffpipe sets it per [[directory]]: write {c.key} = {shown} in each{why}")
        elif not _same_file(c.section, section):
            other = "the dataset TOML" if file == "run" else "run.toml"
            parts.append(f"{lead}; diffpipe reads it from {other}: write {_dotted(c)} = {shown} there{why}")
        else:
            parts.append(f"{lead}; write {_dotted(c)} = {shown} instead{why}")
        lead = "and"
    return "; ".join(parts)


def _anchor_text(key: str, value: Any) -> str:
    shown = toml_value(value)
    return "the" if isinstance(value, dict) or is_secret(key) or len(shown) > 60 else shown


def _same_file(a: str | None, b: str) -> bool:
    return (a in RUN_FILE_SECTIONS) == (b in RUN_FILE_SECTIONS)


def _dotted(c: Change) -> str:
    return f"{c.section}.{c.key}" if c.section in ("model", "adapter", "optimizer", "logging") else str(c.key)


def literal_values(annotation: Any) -> tuple[Any, ...] | None:
    """The allowed values of a ``Literal[...]`` annotation, or None for any other type."""
    import typing

    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None


def run_hint(path: str, value: Any, valid: list[str]) -> str | None:
    """For :func:`diffpipe_core.schema.validate` on run.toml: the diffpipe form of an anchor key, or None."""
    section, _, key = path.rpartition(".")
    if section == "":
        return _hint("run", key, value, valid, "run")
    if section in ("model", "adapter", "optimizer"):
        return _hint(section, key, value, valid, "run")
    return None


def dataset_hint(path: str, value: Any, valid: list[str]) -> str | None:
    """For :func:`diffpipe_core.schema.validate` on a dataset TOML: the diffpipe form of an anchor key, or None."""
    section, _, key = path.rpartition(".")
    if section == "":
        return _hint("dataset", key, value, valid, "dataset")
    if section == "directory":
        return _hint("directory", key, value, valid, "dataset")
    return None


def toml_value(value: Any) -> str:
    """``value`` written as TOML (strings single-quoted when they can be, like diffusion-pipe's examples)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if "'" not in value and "\n" not in value:
            return f"'{value}'"
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, float):
        text = repr(value)
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(text, text)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return toml_value(str(value))


def toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else toml_value(key)


def is_secret(key: str) -> bool:
    """Keys whose values never go into a comment or a message (API keys, tokens)."""
    return any(word in key.lower() for word in SECRET_WORDS)
