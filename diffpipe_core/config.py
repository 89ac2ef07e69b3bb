"""The run config (``run.toml``): schema, loading and validation.

Key names follow tdrussell/diffusion-pipe where the concept is the same. Relative paths are resolved
against the directory of the file that names them. Every key is documented in docs/config.md, which
``diffpipe config-reference`` regenerates from these classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diffpipe_core.registry import PluginError, Registry
from diffpipe_core.sampling.config import SampleConfig, sample_problems
from diffpipe_core.schema import ConfigError, read_toml, validate
from diffpipe_core.types import ModelConfigBase, ModelSpec


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdapterConfig(Strict):
    """``[adapter]``: present means adapter training; absent means full fine-tuning."""

    type: Literal["lora"] = Field("lora", description="Adapter kind. Only peft LoRA for now.")
    rank: int = Field(16, ge=1, description="LoRA rank r.")
    alpha: float | None = Field(
        None, gt=0, description="LoRA alpha; the update is scaled by alpha / rank. Default: equal to rank."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout probability.")
    target_modules: list[str] | None = Field(
        None, description="Module names or regexes to adapt; overrides the model plugin's lora_targets."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the LoRA weights while training."
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


class OptimizerConfig(Strict):
    """``[optimizer]``."""

    type: str = Field(
        "adamw",
        description="'adamw' (torch), 'adamw8bit' (bitsandbytes 8-bit states), 'adamw8bit_kahan' (8-bit states plus "
        "Kahan-compensated bf16/fp16 weights: updates below bf16 resolution still count; use it for full fine-tunes "
        "of bf16 models), 'sgd', or a name a plugin registers.",
    )
    lr: float = Field(2e-5, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="Adam betas.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")


class EvalDatasetRef(Strict):
    """One ``[[eval_datasets]]`` entry."""

    name: str = Field(description="Name used in TensorBoard tags.")
    config: Path = Field(description="Path of the eval dataset TOML.")


class RunConfig(Strict):
    """Top-level keys of ``run.toml``."""

    output_dir: Path = Field(description="Each run writes one timestamped folder under this directory.")
    dataset: Path = Field(description="Path of the dataset TOML.")
    eval_datasets: list[EvalDatasetRef] = Field([], description="Held-out datasets for eval loss.")
    epochs: int = Field(1, ge=1, description="Passes over the dataset (training stops at max_steps if set).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    micro_batch_size_per_gpu: int = Field(1, ge=1, description="Samples per micro-batch on each data-parallel rank.")
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step (they flow through the pipeline together)."
    )
    pipeline_stages: int = Field(1, ge=1, description="Pipeline stages; must divide the number of processes.")
    partition_method: Literal["memory", "parameters", "uniform"] = Field(
        "memory",
        description="How layers are spread over stages: 'memory' balances each stage's estimated peak (weights in "
        "their real dtypes, quantized or swapped where set, trainable tensors with gradients and optimizer state, "
        "and activations of a micro-batch of the largest bucket); 'parameters' by parameter count (frozen ones "
        "included); 'uniform' by layer count. `diffpipe data` (and `validate` with several stages) prints the plan.",
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
    caching_batch_size: int = Field(4, ge=1, description="Batch size for encode_batch while caching.")
    log_every_n_steps: int = Field(1, ge=1, description="TensorBoard/console logging interval.")
    seed: int = Field(42, description="Seed for data order, noise and timesteps.")
    model: dict[str, Any] = Field(
        description="Model table; its keys are defined by the model plugin (`diffpipe config-reference --model NAME`). "
        "Every model takes `type`, `dtype` and `quantize` ('nf4', 'int8' or 'float8': quantized frozen base weights "
        "for LoRA training)."
    )
    adapter: AdapterConfig | None = Field(None, description="Adapter table; leave out for full fine-tuning.")
    optimizer: OptimizerConfig = Field(OptimizerConfig(), description="Optimizer table.")
    sample: SampleConfig | None = Field(None, description="Samples during training; leave out for none.")

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


def load_config(path: Path | str, registry: Registry, model_override: str | None = None) -> ResolvedConfig:
    """Read and validate ``run.toml`` and its ``[model]`` table; raise ConfigError listing every problem.

    Checks paths (dataset file, eval datasets, adapter init) exist, without loading any model.
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
        run = validate(RunConfig, data, source)
    except ConfigError as exc:
        problems.extend(exc.problems)

    model_cfg: ModelConfigBase | None = None
    if isinstance(data.get("model"), dict):
        model_cfg = _validate_model(data["model"], registry, source, base, problems)

    if run is not None:
        if not run.dataset.is_file():
            problems.append(f"{source}: dataset: file not found: {run.dataset}")
        for i, ev in enumerate(run.eval_datasets):
            if not ev.config.is_file():
                problems.append(f"{source}: eval_datasets[{i}].config: file not found: {ev.config}")
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
            if model_cfg.quantize is not None and not spec.block_layers:
                problems.append(
                    f"{source}: model.quantize: model {spec.name!r} names no block layers (ModelSpec.block_layers), "
                    "whose linears are what gets quantized; remove quantize"
                )
            problems.extend(_unknown_formats(run, spec, source))
            if run.sample is not None:
                problems.extend(sample_problems(run.sample, registry.model(model_cfg.type), source))
    if problems:
        raise ConfigError(problems)
    assert run is not None and model_cfg is not None
    return ResolvedConfig(path=path, run=run, model=model_cfg, raw=raw)


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
        model_cfg = validate(schema, table, source, prefix="model.", context={"base_dir": base})
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None
    for key, field in schema.model_fields.items():
        value = getattr(model_cfg, key)
        if isinstance(value, Path) and (field.json_schema_extra or {}).get("must_exist", True):
            resolved = (base / value).resolve()
            if not resolved.exists():
                problems.append(f"{source}: model.{key}: path not found: {resolved}")
                continue
            model_cfg = model_cfg.model_copy(update={key: resolved})
    return model_cfg


def check_world_size(run: RunConfig, world_size: int, source: str) -> None:
    """pipeline_stages must divide the number of processes; data parallelism takes the rest."""
    if world_size % run.pipeline_stages != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            [
                f"{source}: pipeline_stages: {run.pipeline_stages} does not divide the number of processes "
                f"({world_size}); valid values for {world_size} processes: {', '.join(map(str, divisors))}"
            ]
        )
