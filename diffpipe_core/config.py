"""The run config (``run.toml``): schema, loading and validation.

Key names follow tdrussell/diffusion-pipe where the concept is the same. Relative paths are resolved
against the directory of the file that names them. Every key is documented in docs/config.md, which
``diffpipe config-reference`` regenerates from these classes.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diffpipe_core.anchor.keys import run_hint
from diffpipe_core.registry import PluginError, Registry
from diffpipe_core.sampling.config import SampleConfig, sample_problems
from diffpipe_core.schema import ConfigError, read_toml, validate
from diffpipe_core.types import LossSettings, ModelConfigBase, ModelSpec

LOSS_KEYS = ("pseudo_huber_c", "huber_delta", "smooth_l1_beta")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdapterConfig(Strict):
    """``[adapter]``: present means adapter training; absent means full fine-tuning."""

    type: Literal["lora", "lokr", "loha"] = Field(
        "lora",
        description="Adapter kind, all through peft on the model's lora_targets: 'lora'; 'lokr' (Kronecker product "
        "of two factors, LyCORIS' LoKr); 'loha' (Hadamard product of two low-rank products, LyCORIS' LoHa).",
    )
    rank: int = Field(
        16,
        ge=1,
        description="LoRA rank r; for 'lokr' the rank of the decomposed (second) factor, which is kept whole when "
        "rank >= half its size; for 'loha' the rank of each of the two products.",
    )
    alpha: float | None = Field(
        None, gt=0, description="Alpha; the update is scaled by alpha / rank. Default: equal to rank."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout probability ('lora' only).")
    factor: int = Field(
        -1,
        ge=-1,
        description="'lokr' only: the Kronecker factor each dimension is split by (LyCORIS' factor; e.g. 8 splits "
        "3072 into 8 x 384); -1 splits it as evenly as possible.",
    )
    decompose_both: bool = Field(
        False, description="'lokr' only: also write the first (small) factor as a rank-r product."
    )
    rank_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="'lokr'/'loha' only: probability of dropping each output row of the update."
    )
    module_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="'lokr'/'loha' only: probability of skipping a module's update in a step."
    )
    target_modules: list[str] | None = Field(
        None, description="Module names or regexes to adapt; overrides the model plugin's lora_targets."
    )
    exclude_modules: list[str] = Field(
        [],
        description="Regexes (searched in each module's full name, e.g. 'adaln' or '^blocks\\.0\\.') whose modules "
        "are taken out of the adapted ones (lora_targets or target_modules); a pattern that takes out nothing is "
        "refused, naming it.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the adapter weights while training."
    )
    init_from_existing: Path | None = Field(
        None, description="A saved diffpipe adapter folder (or its adapter_model.safetensors) to start from."
    )
    save_formats: list[str] = Field(
        ["diffusers"],
        description="Formats written at each save: 'diffusers' (peft keys under the pipeline prefix), "
        "plus whatever the model plugin's export_adapter knows (e.g. 'comfyui', 'kohya').",
    )

    @property
    def effective_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank)

    @model_validator(mode="after")
    def _kind_keys(self) -> AdapterConfig:
        only = {"dropout": ("lora",), "factor": ("lokr",), "decompose_both": ("lokr",)}
        only |= {"rank_dropout": ("lokr", "loha"), "module_dropout": ("lokr", "loha")}
        for key, kinds in only.items():
            if key in self.model_fields_set and self.type not in kinds and getattr(self, key):
                raise ValueError(
                    f"adapter.{key} applies to type = {' or '.join(repr(k) for k in kinds)} only, not {self.type!r}"
                )
        if self.factor == 0:
            raise ValueError("adapter.factor: 0 is not a factor; use a positive number or -1")
        for pattern in self.exclude_modules:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"adapter.exclude_modules: {pattern!r} is not a regex: {exc}") from None
        return self


class OptimizerConfig(Strict):
    """``[optimizer]``."""

    type: str = Field(
        "adamw",
        description="'adamw' (torch), 'adamw8bit' (bitsandbytes 8-bit states), 'adamw8bit_kahan' (8-bit states plus "
        "Kahan-compensated bf16/fp16 weights: updates below bf16 resolution still count; use it for full fine-tunes "
        "of bf16 models), 'sgd', or a name a plugin registers (diffpipe-optimizers: 'prodigy', "
        "'adamw_schedulefree', 'adamw_optimi' and 'stableadamw' (torch-optimi, Kahan summation for bf16), "
        "'automagic', 'muon' (torch's Muon for 2-D weights, AdamW for the rest), or any pytorch-optimizer class as "
        "'pytorch_optimizer.<Class>', e.g. 'pytorch_optimizer.CAME').",
    )
    lr: float = Field(2e-5, gt=0, description="Peak learning rate (of every parameter group group_lr leaves out).")
    group_lr: dict[str, float] = Field(
        {},
        description="Peak learning rate per parameter group the model plugin names (its parameter_groups hook; "
        "`diffpipe validate` lists them for a wrong name), e.g. { text_encoder_1 = 1e-5 }, or per parameter name "
        "pattern (a key holding * ? or [ is a glob over the trainable parameters' names: { \"*.attn*\" = 1e-4, "
        "\"*.ff*\" = 5e-5 }; the first pattern a parameter matches wins over its named group; a pattern matching no "
        "parameter is refused); 0 freezes a group. Parameters left out train at lr.",
    )
    betas: tuple[float, float] = Field((0.9, 0.99), description="Adam betas.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    kwargs: dict[str, Any] = Field(
        {}, description="Further keyword arguments of the optimizer, e.g. { d_coef = 0.5 } for 'prodigy'."
    )
    force_constant_lr: float | None = Field(
        None,
        gt=0,
        description="Train every parameter group at this learning rate, constant from the first step: lr, group_lr, "
        "warmup_steps and lr_scheduler are set aside (a group_lr of 0 still freezes its group). Applies to a resumed "
        "run too, so it changes the rate of a run in progress (diffusion-pipe's force_constant_lr).",
    )
    offload: bool = Field(
        False,
        description="Keep the optimizer state in host memory between steps; each parameter's state is brought to "
        "the GPU for its own update and sent back, so the GPU holds one parameter's state at a time instead of all "
        "(for AdamW, twice the trainable weights' float32 bytes). For full fine-tunes; costs host-device copies "
        "every step. Optimizers: 'adamw', 'adamw8bit', 'adamw8bit_kahan', 'sgd', 'automagic', 'muon'.",
    )

    gradient_release: bool = Field(
        False,
        description="Full fine-tunes: step each parameter as soon as its gradient is complete in the backward pass "
        "(a post-accumulate-grad hook) and free that gradient, so no stage ever holds the full gradient buffer. Needs "
        "gradient_accumulation_steps = 1 and one data-parallel replica per stage; gradient_clipping then clips each "
        "parameter's gradient by its own norm (the global norm is not known before the first update). Optimizers: as "
        "for offload, with which it combines. See docs/training-methods.md.",
    )

    @model_validator(mode="after")
    def _offloadable(self) -> OptimizerConfig:
        from diffpipe_core.optimizer_names import OFFLOADABLE_OPTIMIZERS

        if self.gradient_release and self.type not in OFFLOADABLE_OPTIMIZERS:
            raise ValueError(
                f"optimizer.gradient_release: {self.type!r} updates its parameters together (or is not known to update "
                f"each from its own state alone), so it cannot step one parameter as its gradient is ready; gradient "
                f"release works with {', '.join(repr(n) for n in OFFLOADABLE_OPTIMIZERS)}"
            )
        if self.offload and self.type not in OFFLOADABLE_OPTIMIZERS:
            raise ValueError(
                f"optimizer.offload: {self.type!r} updates its parameters together (or is not known to update each "
                f"from its own state alone), so its state cannot be offloaded one parameter at a time; offload works "
                f"with {', '.join(repr(n) for n in OFFLOADABLE_OPTIMIZERS)}"
            )
        return self

    @model_validator(mode="after")
    def _group_lrs(self) -> OptimizerConfig:
        bad = {k: v for k, v in self.group_lr.items() if not v >= 0}
        if bad:
            raise ValueError(f"optimizer.group_lr: learning rates must be >= 0, got {bad}")
        return self


# ------------------------------------------------------------------------------------------ [ema] (issue 42)
class EmaConfig(Strict):
    """``[ema]``: an exponential moving average of the trained weights (LoRA or full), kept per pipeline stage."""

    decay: float = Field(
        0.999, gt=0, lt=1, description="Each update: ema = decay * ema + (1 - decay) * weights."
    )
    start_step: int = Field(
        0, ge=0, description="Until this optimizer step the average is a copy of the weights; updates start after it."
    )
    every_n_steps: int = Field(1, ge=1, description="Update the average every N optimizer steps (after start_step).")
    device: Literal["cpu", "stage"] = Field(
        "stage",
        description="Where the average lives: 'stage' (the stage's device, beside the weights) or 'cpu' (host "
        "memory: no accelerator memory, a copy each update).",
    )
    use_for_samples: bool = Field(
        False, description="Samples and eval losses during training use the average instead of the weights."
    )


class WandbConfig(Strict):
    """``[logging] wandb``: Weights & Biases, beside TensorBoard (needs ``pip install diffpipe-core[wandb]``)."""

    project: str = Field(description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (user or team); default: yours.")
    name: str | None = Field(None, description="Run name; default: the run folder's name.")
    group: str | None = Field(None, description="W&B run group.")
    tags: list[str] = Field([], description="W&B tags.")
    notes: str | None = Field(None, description="W&B notes.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode; default: the WANDB_MODE environment variable, else 'online'."
    )


class LoggingConfig(Strict):
    """``[logging]``: where metrics go besides ``metrics.jsonl`` and TensorBoard (``<run>/tensorboard``)."""

    wandb: WandbConfig | None = Field(
        None,
        description="Also log scalars, samples and the resolved config to Weights & Biases (rank 0 only), e.g. "
        "{ project = \"my-loras\" }.",
    )


class EvalDatasetRef(Strict):
    """One ``[[eval_datasets]]`` entry."""

    name: str = Field(description="Name used in TensorBoard tags.")
    config: Path = Field(description="Path of the eval dataset TOML.")


class RunConfig(Strict):
    """Top-level keys of ``run.toml``."""

    output_dir: Path | None = Field(
        None,
        description="Each run writes one timestamped folder under this directory. Required to train "
        "(`diffpipe sample` writes to --out).",
    )
    dataset: Path | None = Field(
        None,
        description="Path of the dataset TOML. Required to train and cache; `diffpipe sample` reads only its first "
        "resolution and frame bucket (as the default sample size) when the file is there, and no media or cache.",
    )
    eval_datasets: list[EvalDatasetRef] = Field([], description="Held-out datasets for eval loss.")
    epochs: int = Field(1, ge=1, description="Passes over the dataset (training stops at max_steps if set).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    micro_batch_size_per_gpu: int | list[tuple[int, int]] = Field(
        1,
        description="Samples per micro-batch on each data-parallel rank: a number, or per resolution as "
        "[[resolution, size], ...] (e.g. [[512, 4], [1024, 1]]): each bucket takes the size of the resolution "
        "nearest to its sqrt(width x height), as in diffusion-pipe. Micro-batches of one step may then differ in "
        "size; each weighs the same in the step's mean loss.",
    )
    image_micro_batch_size_per_gpu: int | list[tuple[int, int]] | None = Field(
        None,
        description="Like micro_batch_size_per_gpu, for the 1-frame buckets (images) of a video dataset. "
        "Default: micro_batch_size_per_gpu.",
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step (they flow through the pipeline together)."
    )
    pipeline_stages: int = Field(1, ge=1, description="Pipeline stages; must divide the number of processes.")
    sequence_parallel: int = Field(
        1,
        ge=1,
        description="Ranks that split each micro-batch's token sequence (Ulysses: attention exchanges heads with "
        "DeepSpeed's all-to-all, everything else runs on each rank's tokens). Processes = pipeline_stages x "
        "sequence_parallel x data-parallel replicas; it must divide the model's attention heads.",
    )
    zero_stage: Literal[0, 1] = Field(
        0,
        description="1: DeepSpeed's ZeRO stage 1, the optimizer state sharded over the data-parallel replicas of "
        "each pipeline stage (each keeps 1/N of it, on a float32 copy of its share of the trainable weights); full "
        "fine-tunes and adapters alike. Optimizers 'adamw' and 'sgd', one parameter group (no group_lr), without "
        "offload or gradient_release. Checkpoints hold the whole state, so a run resumes on any layout. 0: off.",
    )
    partition_method: Literal["memory", "parameters", "uniform"] = Field(
        "memory",
        description="How layers are spread over stages: 'memory' balances each stage's estimated peak (weights in "
        "their real dtypes, quantized or swapped where set, trainable tensors with gradients and optimizer state, "
        "and activations of a micro-batch of the largest bucket, or what saving holds when that is more); "
        "'parameters' by parameter count (frozen ones included); 'uniform' by layer count. `diffpipe data` (and "
        "`validate` with several stages) prints the plan.",
    )
    partition_split: list[int] | None = Field(
        None,
        description="Explicit split: the layer indices where stages 2..N begin (pipeline_stages - 1 ascending values).",
    )
    gradient_clipping: float | None = Field(1.0, ge=0, description="Max global gradient norm; 0 or absent disables.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup from 0 over this many steps.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR schedule after warmup (linear and cosine decay to 0 at the last step)."
    )
    activation_checkpointing: bool | Literal["offload"] = Field(
        False,
        description="true: recompute the model's blocks' activations in backward instead of keeping them; "
        "'offload': also keep each block's saved input in (pinned) CPU memory until backward. Works with any "
        "number of pipeline stages.",
    )
    blocks_to_swap: int = Field(
        0,
        ge=0,
        description="Keep the frozen weights of this many of each stage's blocks in (pinned) CPU memory and bring "
        "each to the GPU just before it runs, forward and backward, overlapping the copy with compute; LoRA "
        "weights stay on the GPU. Works with any number of stages; on a CPU-only run it changes nothing.",
    )
    save_every_n_epochs: int | None = Field(None, ge=1, description="Save the adapter/model every N epochs.")
    save_every_n_steps: int | None = Field(None, ge=1, description="Save the adapter/model every N steps.")
    checkpoint_every_n_minutes: float | None = Field(
        None, gt=0, description="Write a resumable checkpoint every N minutes."
    )
    checkpoint_every_n_steps: int | None = Field(None, ge=1, description="Write a resumable checkpoint every N steps.")
    checkpoint_every_n_epochs: int | None = Field(
        None, ge=1, description="Write a resumable checkpoint at the end of every N-th epoch."
    )
    keep_checkpoints: int = Field(2, ge=1, description="How many resumable checkpoints to keep.")
    save_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of saved adapters and models."
    )
    save_model_formats: list[str] = Field(
        [],
        description="Full fine-tuning only: extra formats the model plugin's export_model writes beside the "
        "saved shards, each into its own subfolder (e.g. 'diffusers', 'single_file').",
    )
    eval_every_n_epochs: int | None = Field(None, ge=1, description="Eval loss every N epochs.")
    eval_every_n_steps: int | None = Field(None, ge=1, description="Eval loss every N steps.")
    eval_before_first_step: bool = Field(
        False,
        description="Also eval loss before the first step (logged at step 0; not when resuming). diffusion-pipe's "
        "default is true.",
    )
    pseudo_huber_c: float | None = Field(
        None,
        gt=0,
        description="Train with the pseudo-Huber loss sqrt(d^2 + c^2) - c of the error d instead of d^2 (about d^2 / "
        "2c for small errors, |d| for large ones). Needs a model whose compute_loss takes the context.",
    )
    huber_delta: float | None = Field(
        None, gt=0, description="Train with the Huber loss of this delta instead of the squared error."
    )
    smooth_l1_beta: float | None = Field(
        None, gt=0, description="Train with the smooth L1 loss of this beta instead of the squared error."
    )
    compile: bool | Literal["inductor", "aot_eager", "eager", "cudagraphs"] = Field(
        False,
        description="torch.compile each block layer of the stage in place (shapes that change between buckets "
        "recompile once, then run dynamic): true uses torch's default backend ('inductor'; faster steps on GPUs after "
        "slow first ones; on a CPU it needs a C++ compiler and minutes); a backend name picks another, e.g. "
        "'aot_eager' to tell a compiler problem from a model one.",
    )
    caching_batch_size: int = Field(4, ge=1, description="Batch size for encode_batch while caching.")
    log_every_n_steps: int = Field(1, ge=1, description="TensorBoard/console logging interval.")
    seed: int = Field(42, description="Seed for data order, noise and timesteps.")
    model: dict[str, Any] = Field(
        description="Model table; its keys are defined by the model plugin (`diffpipe config-reference --model NAME`). "
        "Every model takes `type`, `dtype`, `quantize` ('nf4', 'int8', 'float8' or 'float8_e5m2': quantized "
        "frozen base weights for LoRA training), `merge_adapters` and `cfg` (see \"[model] keys every model takes\")."
    )
    adapter: AdapterConfig | None = Field(None, description="Adapter table; leave out for full fine-tuning.")
    optimizer: OptimizerConfig = Field(OptimizerConfig(), description="Optimizer table.")
    ema: EmaConfig | None = Field(
        None,
        description="Keep an EMA of the trained weights, saved beside them (saved/<name>/ema/) in the same formats "
        "and in checkpoints; leave out for none.",
    )
    sample: SampleConfig | None = Field(None, description="Samples during training; leave out for none.")
    logging: LoggingConfig = Field(LoggingConfig(), description="Logging table.")

    @field_validator("micro_batch_size_per_gpu", "image_micro_batch_size_per_gpu")
    @classmethod
    def _check_batch_sizes(cls, value: int | list[tuple[int, int]] | None) -> int | list[tuple[int, int]] | None:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1")
        if isinstance(value, list):
            if not value:
                raise ValueError("give at least one [resolution, size] pair, e.g. [[512, 4], [1024, 1]]")
            for resolution, size in value:
                if resolution < 16 or size < 1:
                    raise ValueError(
                        f"[{resolution}, {size}]: a resolution of at least 16 and a size of at least 1, e.g. [512, 4]"
                    )
            if len({r for r, _ in value}) != len(value):
                raise ValueError("each resolution may appear once")
        return value

    @property
    def loss(self) -> LossSettings:
        return LossSettings(self.pseudo_huber_c, self.huber_delta, self.smooth_l1_beta)

    def micro_batch_size_for(self, width: int, height: int, frames: int = 1) -> int:
        """The micro-batch size of a bucket: per resolution, the entry nearest to sqrt(width x height)."""
        table = self.micro_batch_size_per_gpu
        if frames == 1 and self.image_micro_batch_size_per_gpu is not None:
            table = self.image_micro_batch_size_per_gpu
        if isinstance(table, int):
            return table
        side = math.sqrt(width * height)
        return min(table, key=lambda entry: abs(entry[0] - side))[1]

    @property
    def default_micro_batch_size(self) -> int:
        """The size DeepSpeed is told (it only uses it for its batch-size bookkeeping): the first entry."""
        table = self.micro_batch_size_per_gpu
        return table if isinstance(table, int) else table[0][1]

    @model_validator(mode="after")
    def _check_loss(self) -> RunConfig:
        chosen = [k for k in LOSS_KEYS if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)} are each a loss; set one of them")
        return self

    @model_validator(mode="after")
    def _check_gradient_release(self) -> RunConfig:
        if not self.optimizer.gradient_release:
            return self
        if self.adapter is not None:
            raise ValueError(
                "optimizer.gradient_release: only for full fine-tunes (leave [adapter] out); an adapter's gradients "
                "are a small fraction of the model, there is no gradient buffer worth releasing"
            )
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"optimizer.gradient_release: needs gradient_accumulation_steps = 1 (it is "
                f"{self.gradient_accumulation_steps}): each parameter is stepped as soon as one micro-batch's backward "
                "completes its gradient, so there is no gradient to accumulate into; use a larger "
                "micro_batch_size_per_gpu instead, or turn gradient release off"
            )
        return self

    @model_validator(mode="after")
    def _check_zero_stage(self) -> RunConfig:
        from diffpipe_core.optimizer_names import ZERO_OPTIMIZERS

        if not self.zero_stage:
            return self
        opt, why = self.optimizer, None
        if opt.type not in ZERO_OPTIMIZERS:
            why = (f"optimizer.type = {opt.type!r}: DeepSpeed's ZeRO optimizer steps a flat float32 partition of the "
                   f"weights, which only elementwise optimizers take unchanged; use "
                   f"{' or '.join(repr(n) for n in ZERO_OPTIMIZERS)}")
        elif opt.offload or opt.gradient_release:
            key = "offload" if opt.offload else "gradient_release"
            why = (f"optimizer.{key} = true: the sharded state lives in DeepSpeed's flat partitions, which diffpipe's "
                   f"{key} cannot step one parameter at a time; turn {key} off (ZeRO already divides the state)")
        elif opt.group_lr:
            why = (f"optimizer.group_lr = {dict(opt.group_lr)}: the optimizer step's global gradient norm is taken "
                   "over one parameter group's partition; leave group_lr out")
        if why:
            raise ValueError(f"zero_stage = {self.zero_stage} (valid: 0 or 1) cannot work with {why}")
        return self

    @model_validator(mode="after")
    def _check_split(self) -> RunConfig:
        if self.partition_split is not None:
            if len(self.partition_split) != self.pipeline_stages - 1:
                raise ValueError(
                    f"partition_split has {len(self.partition_split)} values but pipeline_stages="
                    f"{self.pipeline_stages} needs {self.pipeline_stages - 1}"
                )
            if (
                sorted(set(self.partition_split)) != list(self.partition_split)
                or min(self.partition_split, default=1) < 1
            ):
                raise ValueError("partition_split must be strictly ascending layer indices >= 1")
        return self


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated run: the run config, the plugin's model config, and where they came from."""

    path: Path
    run: RunConfig
    model: ModelConfigBase
    raw: dict[str, Any]

    @property
    def model_name(self) -> str:
        return self.model.type


def _resolve_paths(data: dict[str, Any], base: Path, keys: tuple[str, ...]) -> None:
    for key in keys:
        if isinstance(data.get(key), str):
            data[key] = str((base / Path(data[key]).expanduser()).resolve())


Purpose = Literal["train", "sample"]


def load_config(
    path: Path | str, registry: Registry, model_override: str | None = None, purpose: Purpose = "train"
) -> ResolvedConfig:
    """Read and validate ``run.toml`` and its ``[model]`` table; raise ConfigError listing every problem.

    Checks paths (dataset file, eval datasets, adapter init) exist, without loading any model. With
    ``purpose="sample"`` (``diffpipe sample``) the keys only training needs may be absent: ``output_dir``,
    ``dataset`` (or its file), the eval datasets and ``[sample]``'s when-to-sample keys.
    """
    path = Path(path).resolve()
    raw = read_toml(path)
    source = str(path)
    data = dict(raw)
    base = path.parent
    _resolve_paths(data, base, ("output_dir", "dataset"))
    if isinstance(data.get("eval_datasets"), list):
        data["eval_datasets"] = [dict(e) if isinstance(e, dict) else e for e in data["eval_datasets"]]
        for entry in data["eval_datasets"]:
            if isinstance(entry, dict):
                _resolve_paths(entry, base, ("config",))
    if isinstance(data.get("adapter"), dict):
        data["adapter"] = dict(data["adapter"])
        _resolve_paths(data["adapter"], base, ("init_from_existing",))
    if isinstance(data.get("sample"), dict):
        data["sample"] = dict(data["sample"])
        _resolve_paths(data["sample"], base, ("prompts",))
        controls = data["sample"].get("control_images")
        if isinstance(controls, list):
            data["sample"]["control_images"] = [
                [str((base / Path(c).expanduser()).resolve()) if isinstance(c, str) else c for c in entry]
                if isinstance(entry, list)
                else str((base / Path(entry).expanduser()).resolve()) if isinstance(entry, str) else entry
                for entry in controls
            ]

    problems: list[str] = []
    model_table = data.get("model")
    if isinstance(model_table, dict):
        model_table = dict(model_table)
        if model_override:
            if model_table.get("type") not in (None, model_override):
                problems.append(
                    f"{source}: model.type: {model_table['type']!r} conflicts with --model {model_override!r}"
                )
            model_table["type"] = model_override
        data["model"] = model_table
    elif model_table is None and model_override:
        data["model"] = {"type": model_override}

    run: RunConfig | None = None
    try:
        run = validate(RunConfig, data, source, hints=run_hint)
    except ConfigError as exc:
        problems.extend(exc.problems)

    model_cfg: ModelConfigBase | None = None
    if isinstance(data.get("model"), dict):
        model_cfg = _validate_model(data["model"], registry, source, base, problems)

    if run is not None:
        if purpose == "train":
            problems.extend(_training_paths(run, source))
        if run.adapter and run.adapter.init_from_existing and not run.adapter.init_from_existing.exists():
            problems.append(f"{source}: adapter.init_from_existing: not found: {run.adapter.init_from_existing}")
        if model_cfg is not None:
            spec = registry.model(model_cfg.type).spec
            if run.adapter is None and not spec.supports_full_finetune:
                problems.append(f"{source}: adapter: model {spec.name!r} supports only adapter training; add [adapter]")
            if run.adapter is not None and not spec.supports_lora:
                problems.append(f"{source}: adapter: model {spec.name!r} does not support LoRA")
            if run.adapter is None and model_cfg.quantize is not None:
                problems.append(
                    f"{source}: model.quantize: {model_cfg.quantize!r} quantizes the frozen base weights, which a full "
                    "fine-tune would have to train; add an [adapter] table (LoRA on the quantized base) or remove it"
                )
            if run.adapter is None:
                problems.extend(_quantized_file_problems(model_cfg, source))
            if model_cfg.quantize is not None and not spec.block_layers:
                problems.append(
                    f"{source}: model.quantize: model {spec.name!r} names no block layers (ModelSpec.block_layers), "
                    "whose linears are what gets quantized; remove quantize"
                )
            problems.extend(_unknown_formats(run, spec, source))
            problems.extend(_component_problems(run, registry.model(model_cfg.type), model_cfg, source))
            plugin = registry.model(model_cfg.type)
            if not run.loss.is_mse and not plugin.takes("compute_loss", "context"):
                key = next(k for k in LOSS_KEYS if getattr(run, k) is not None)
                problems.append(
                    f"{source}: {key}: model {spec.name!r} computes its own loss (its compute_loss takes no context), "
                    "so this key would change nothing; remove it"
                )
            problems.extend(_unknown_optimizer(run, registry, source))
            if run.sample is not None:
                when = purpose == "train"
                problems.extend(sample_problems(run.sample, registry.model(model_cfg.type), source, when))
    if problems:
        raise ConfigError(problems)
    assert run is not None and model_cfg is not None
    run = with_model_group_lr(run, registry.model(model_cfg.type), model_cfg)
    return ResolvedConfig(path=path, run=run, model=model_cfg, raw=raw)


def with_model_group_lr(run: RunConfig, plugin: Any, model_cfg: ModelConfigBase) -> RunConfig:
    """``run`` with the learning rates the model's ``[model]`` table sets for its parameter groups (the plugin's
    ``group_lr_defaults``: Anima's ``llm_adapter_lr``) under ``[optimizer] group_lr``, which wins for a group both
    name."""
    defaults = plugin.call("group_lr_defaults", model_config=model_cfg) or {}
    if not defaults:
        return run
    group_lr = {**defaults, **run.optimizer.group_lr}
    return run.model_copy(update={"optimizer": run.optimizer.model_copy(update={"group_lr": group_lr})})


def _training_paths(run: RunConfig, source: str) -> list[str]:
    """What training needs that sampling does not: an output folder and the dataset files."""
    problems = []
    for key in ("output_dir", "dataset"):
        if getattr(run, key) is None:
            problems.append(f"{source}: {key}: required key is missing (training needs it)")
    if run.dataset is not None and not run.dataset.is_file():
        problems.append(f"{source}: dataset: file not found: {run.dataset}")
    for i, ev in enumerate(run.eval_datasets):
        if not ev.config.is_file():
            problems.append(f"{source}: eval_datasets[{i}].config: file not found: {ev.config}")
    return problems
def _unknown_optimizer(run: RunConfig, registry: Registry, source: str) -> list[str]:
    from diffpipe_core.optimizer_names import is_known_optimizer, optimizer_names

    names = optimizer_names(registry.pm)
    if is_known_optimizer(run.optimizer.type, names):
        return []
    close = difflib.get_close_matches(run.optimizer.type, names, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return [f"{source}: optimizer.type: unknown optimizer {run.optimizer.type!r}.{hint} Available: {', '.join(names)}"]


def _unknown_formats(run: RunConfig, spec: ModelSpec, source: str) -> list[str]:
    """Save formats the model plugin does not declare in ``ModelSpec``: found now, not at the first save."""
    problems = []
    adapter_formats = run.adapter.save_formats if run.adapter else []
    checks = [
        ("adapter.save_formats", adapter_formats, {"diffusers", *spec.adapter_formats}),
        ("save_model_formats", run.save_model_formats, set(spec.model_formats)),
    ]
    for key, asked, known in checks:
        for fmt in asked:
            if fmt not in known:
                offer = ", ".join(repr(f) for f in sorted(known)) or "none"
                problems.append(
                    f"{source}: {key}: model {spec.name!r} cannot export format {fmt!r}; it exports: {offer}"
                )
    return problems


def is_lr_pattern(key: str) -> bool:
    """Whether an ``[optimizer] group_lr`` key is a glob over parameter names (it holds ``*``, ``?`` or ``[``)
    rather than the name of a group the model plugin names."""
    return any(c in key for c in "*?[")


def _component_problems(run: RunConfig, plugin: Any, model_cfg: ModelConfigBase, source: str) -> list[str]:
    """``[optimizer] group_lr`` names groups the plugin has; a LoKr/LoHa is saved only in layouts the plugin
    names keys for."""
    problems = []
    if run.optimizer.group_lr:
        groups = list(plugin.call("parameter_groups", model_config=model_cfg) or {"model": []})
        for name in run.optimizer.group_lr:
            if name not in groups and not is_lr_pattern(name):
                problems.append(
                    f"{source}: optimizer.group_lr: model {plugin.name!r} has no parameter group {name!r}; "
                    f"its groups: {', '.join(repr(g) for g in groups)} (or write a parameter name pattern with * "
                    "such as \"*.attn*\")"
                )
    adapter = run.adapter
    if adapter is not None and adapter.type != "lora" and model_cfg.quantize == "nf4":
        # peft reshapes a LoKr/LoHa update to the base weight's shape, which nf4 packs
        problems.append(
            f"{source}: model.quantize: 'nf4' works with type = 'lora' only; a {adapter.type!r} adapter trains on "
            "'int8' or 'float8' base weights"
        )
    if adapter is not None and adapter.type != "lora":
        other = [f for f in adapter.save_formats if f != "diffusers"]
        if other and not plugin.has("adapter_key_names"):
            problems.append(
                f"{source}: adapter.save_formats: model {plugin.name!r} saves a {adapter.type!r} adapter in the "
                f"'diffusers' layout only (its plugin names no {other[0]!r} keys for LoKr/LoHa); remove {other}"
            )
    return problems


def _validate_model(
    table: dict[str, Any], registry: Registry, source: str, base: Path, problems: list[str]
) -> ModelConfigBase | None:
    name = table.get("type")
    if not isinstance(name, str):
        problems.append(f"{source}: model.type: required; name an installed model (or pass --model)")
        return None
    try:
        plugin = registry.model(name)
    except PluginError as exc:
        problems.append(f"{source}: model.type: {exc}")
        return None
    schema = plugin.spec.config_schema
    try:
        model_cfg = validate(schema, table, source, prefix="model.", context={"base_dir": base}, hints=run_hint)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None
    for key, field in schema.model_fields.items():
        if not (field.json_schema_extra or {}).get("must_exist", True):
            continue
        value = getattr(model_cfg, key)
        if isinstance(value, Path):
            resolved = _existing(base, value, f"{source}: model.{key}", problems)
            if resolved is not None:
                model_cfg = model_cfg.model_copy(update={key: resolved})
        elif isinstance(value, tuple) and value:  # a list of files ([model] text_encoders): paths or {path, ...}
            items = []
            for i, item in enumerate(value):
                where = f"{source}: model.{key}[{i}]"
                if isinstance(item, Path):
                    items.append(_existing(base, item, where, problems) or item)
                elif isinstance(getattr(item, "path", None), Path):
                    found = _existing(base, item.path, f"{where}.path", problems)
                    items.append(item.model_copy(update={"path": found}) if found else item)
                else:
                    items.append(item)
            model_cfg = model_cfg.model_copy(update={key: tuple(items)})
    return model_cfg


def _quantized_file_problems(model_cfg: ModelConfigBase, source: str) -> list[str]:
    """A full fine-tune of a diffusion model whose file is quantized (ComfyUI's fp8 scaled or int8): refused, as for
    ``quantize`` (reads the file's header only)."""
    from diffpipe_core.component_files import read_component_file

    file = getattr(model_cfg, "diffusion_model", None)
    if file is None or not Path(file).is_file():
        return []
    try:
        quantized = read_component_file(Path(file), "diffusion_model").quantized
    except ValueError:
        return []  # the model's own file checks name it
    if not quantized:
        return []
    return [
        f"{source}: model.diffusion_model: {file} is quantized ({len(quantized)} layers), and a full fine-tune would "
        "have to train those weights; add an [adapter] table (LoRA on the quantized base) or give a bf16/fp16 file"
    ]


def _existing(base: Path, value: Path, where: str, problems: list[str]) -> Path | None:
    """``value`` resolved against the config's folder, or None (with a problem naming it) when it does not exist."""
    resolved = (base / value.expanduser()).resolve()
    if not resolved.exists():
        problems.append(f"{where}: path not found: {resolved}")
        return None
    return resolved


def check_world_size(run: RunConfig, world_size: int, source: str) -> None:
    """pipeline_stages x sequence_parallel must divide the number of processes; data parallelism takes the rest."""
    ways = run.pipeline_stages * run.sequence_parallel
    if run.sequence_parallel > 1 and world_size % ways != 0:
        fits = [str(ways * k) for k in range(1, 4)]
        raise ConfigError(
            [
                f"{source}: pipeline_stages ({run.pipeline_stages}) x sequence_parallel ({run.sequence_parallel}) = "
                f"{ways} does not divide the number of processes ({world_size}); run {', '.join(fits)}, ... processes"
            ]
        )
    if world_size % run.pipeline_stages != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            [
                f"{source}: pipeline_stages: {run.pipeline_stages} does not divide the number of processes "
                f"({world_size}); valid values for {world_size} processes: {', '.join(map(str, divisors))}"
            ]
        )
