"""Training runs in plugin tests: one call trains a tiny project through the real CLI, and the checks every plugin's
run tests share (the loss fell, each stage saved its share, the saved LoRA reproduces the trained model in the
model's diffusers pipeline, the ComfyUI file applies like the separate LoRAs).

A plugin's ``conftest.py`` builds its project once per session and trains it with :func:`train`; its tests take
that run folder and call these checks, so every plugin asserts the same things the same way.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.testing.processes import cli_env, run_diffpipe


def run_toml(
    model: dict[str, Any],
    optimizer: dict[str, Any],
    adapter: dict[str, Any] | None = None,
    sample: dict[str, Any] | None = None,
    **top: Any,
) -> str:
    """A run config for a test project: ``dataset.toml`` beside it, output in ``out``, float32 saves, then the
    ``top`` keys (``max_steps``, ``pipeline_stages``, ...) and the ``[model]``, ``[adapter]`` (left out: a full
    fine-tune), ``[optimizer]`` and ``[sample]`` tables."""
    from diffpipe_core.anchor.keys import toml_key, toml_value

    def lines(table: dict[str, Any]) -> list[str]:
        return [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]

    text = lines({"output_dir": "out", "dataset": "dataset.toml", "save_dtype": "float32", **top})
    for name, table in (("model", model), ("adapter", adapter), ("optimizer", optimizer), ("sample", sample)):
        if table is not None:
            text += ["", f"[{name}]", *lines(table)]
    return "\n".join(text) + "\n"


def lora_run_toml(
    model: dict[str, Any],
    lr: float,
    sample: dict[str, Any] | None = None,
    rank: int = 4,
    alpha: float = 8.0,
    **top: Any,
) -> str:
    """:func:`run_toml` of a plugin's tiny LoRA run: the ``[model]`` table (``type`` and the model's own keys) at
    ``path = "model"`` in float32 (weights and encoders), a ``rank`` / ``alpha`` LoRA saved in the diffusers and
    ComfyUI formats, ``[optimizer] lr``, micro-batches of 2 unless ``top`` says otherwise."""
    model = {"path": "model", "dtype": "float32", "encoder_dtype": "float32", **model}
    adapter = {"rank": rank, "alpha": alpha, "save_formats": ["diffusers", "comfyui"]}
    return run_toml(model, {"lr": lr}, adapter, sample, **{"micro_batch_size_per_gpu": 2, **top})


def train(root: Path, config: Path | str, procs: int, timeout: float = 500, **env: str) -> Path:
    """``diffpipe train --config CONFIG --num-procs PROCS`` in ``root``; asserts it succeeded without library chatter
    (transformers' "Loading weights" bars stay behind --verbose) and returns the run folder it made."""
    return train_with_output(root, config, procs, timeout, **env)[0]


def train_with_output(root: Path, config: Path | str, procs: int, timeout: float = 500, **env: str) -> tuple[Path, str]:
    """:func:`train`, also returning what the command printed."""
    output_dirs = {p for p in Path(root).rglob("*") if p.is_dir()}
    result = run_diffpipe(
        ["train", "--config", str(config), "--num-procs", str(procs)], cwd=root, timeout=timeout, env=cli_env(**env)
    )
    assert result.returncode == 0, result.output[-4000:]
    assert "Loading weights" not in result.output, result.output[-4000:]
    made = [p for p in Path(root).rglob("run_info.json") if p.parent not in output_dirs]
    assert len(made) == 1, f"expected one new run folder, found {made}"
    return made[0].parent, result.output


#: the captions of a plugin's shared tiny image run (the first is its samples' prompt)
IMAGE_CAPTIONS = ("a red cat", "a blue dog", "a green tree", "a small house")


def image_run(root: Path, write_model: Callable[[Path], Any], config: str, size: int = 32) -> Path:
    """A plugin's one shared tiny image run: ``write_model(root / "model")``, 4 captioned ``size`` x ``size`` images
    (:data:`IMAGE_CAPTIONS`) with their ``dataset.toml``, ``config`` as ``run.toml`` (e.g. :func:`lora_run_toml`),
    trained through the CLI in 1 process. Returns the run folder."""
    from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset

    root = Path(root)
    write_model(root / "model")
    write_image_dataset(root / "data", len(IMAGE_CAPTIONS), size=(size, size), captions=list(IMAGE_CAPTIONS))
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[size], enable_ar_bucket=False)
    (root / "run.toml").write_text(config)
    return train(root, "run.toml", 1)


#: the captions of the tone clips of a plugin's shared audio run (:func:`tone_run`)
TONE_CAPTIONS = ("a bell", "a bell ringing", "a tone", "a high tone")


def tone_project(
    root: Path,
    write_model: Callable[[Path], Any],
    model: dict[str, Any],
    frames: int,
    frame_buckets: list[int],
    steps: int,
    sample: dict[str, Any] | None = None,
    fps: int = 24,
    **top: Any,
) -> Path:
    """The project of a plugin's tiny audio run in ``root``: ``write_model(root / "model")``, 4 clips of ``frames``
    frames at ``fps`` with a 440 Hz tone track (:data:`TONE_CAPTIONS`) and 2 images without sound, all 64 x 64, with
    their ``dataset.toml`` (``frame_buckets``, no aspect buckets), and ``run.toml``: a LoRA (rank 4, alpha 8, lr 2e-2,
    :func:`lora_run_toml`) with ``train_audio`` and uniform times (then the ``model`` keys: ``type``, the model's own),
    ``steps`` steps of 2 micro-batches of 2, seed 3, one checkpoint at the end, ``sample`` (``[sample]``; None: no
    samples) and the ``top`` keys (``pipeline_stages``, ``partition_split``, ...). Returns ``root``."""
    from diffpipe_core.testing.media import write_clip_dataset, write_dataset_toml, write_image_dataset

    root = Path(root)
    write_model(root / "model")
    data = root / "data"
    write_clip_dataset(data, frames, TONE_CAPTIONS, size=(64, 64), fps=fps, audio="tone")
    write_image_dataset(data, 2, size=(64, 64), captions=["a cat", "a dog"])
    write_dataset_toml(root / "dataset.toml", data, resolutions=[64], enable_ar_bucket=False,
                       frame_buckets=frame_buckets)
    model = {"timestep_sample_method": "uniform", "train_audio": True, **model}
    top = {"max_steps": steps, "gradient_accumulation_steps": 2, "seed": 3, "checkpoint_every_n_steps": steps, **top}
    (root / "run.toml").write_text(lora_run_toml(model, 2e-2, sample, 4, 8.0, **top))
    return root


def tone_run(root: Path, write_model: Callable[[Path], Any], model: dict[str, Any], procs: int, frames: int,
             frame_buckets: list[int], steps: int, sample: dict[str, Any] | None = None, fps: int = 24,
             **top: Any) -> Path:
    """A plugin's shared tiny audio run (issue 40): :func:`tone_project` in ``root`` trained through the CLI on
    ``procs`` processes. Returns the run folder."""
    tone_project(root, write_model, model, frames, frame_buckets, steps, sample, fps, **top)
    return train(root, "run.toml", procs=procs, timeout=500)


def stages_run(run: Path, config: str, stages: int = 2) -> Path:
    """The project of :func:`image_run`'s ``run`` trained again from its cache with ``config`` (``run2.toml``: its
    ``pipeline_stages``) in ``stages`` processes. Returns the new run folder."""
    root = Path(run).parent.parent
    (root / "run2.toml").write_text(config)
    return train(root, "run2.toml", stages)


def assert_stages_train_as_one(staged: Path, one: Path, steps: int, stages: int = 2) -> None:
    """:func:`stages_run`'s ``staged`` run trained ``steps`` steps in ``stages`` stages (one parameter file each) and
    drew the losses of the 1-process run ``one``'s first ``steps``."""
    import pytest

    assert_trained_in_stages(staged, steps, stages)
    assert losses(staged) == pytest.approx(losses(one)[:steps], rel=1e-4)


def assert_trains_as(run: Path, reference: Path, rel: float = 1e-4, atol: float = 1e-5) -> None:
    """``run`` (another process layout: sequence ranks, stages) logged ``reference``'s losses within ``rel`` and saved
    its LoRA (``saved/final``, diffusers format) within ``atol``."""
    import pytest

    from diffpipe_core.adapters import read_adapter

    assert losses(run) == pytest.approx(losses(reference), rel=rel), (losses(run), losses(reference))
    got, want = read_adapter(run / "saved" / "final")[0], read_adapter(reference / "saved" / "final")[0]
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=1e-3, atol=atol, msg=key)


def losses(run: Path) -> list[float]:
    """The run's training losses in step order."""
    return [loss for _, loss in sorted(train_losses(run).items())]


def assert_loss_falls(run: Path, steps: int, window: int, factor: float = 0.85) -> list[float]:
    """The run logged ``steps`` finite losses, and the mean of the last ``window`` is below ``factor`` times the mean
    of the first ``window``. Returns the losses."""
    seq = losses(run)
    assert len(seq) == steps and all(math.isfinite(v) for v in seq), seq
    first, last = sum(seq[:window]) / window, sum(seq[-window:]) / window
    assert last < factor * first, f"loss did not fall: first {window} steps {first:.4f}, last {window} {last:.4f}"
    return seq


def one_process_run(run: Path) -> Path:
    """The project of a multi-stage ``run`` (its ``run.toml``: ``pipeline_stages``, ``partition_split``) trained
    again from its cache in 1 process and 1 stage (``run1.toml``; without its ``[sample]``: the rerun is for its
    losses and LoRA). Returns the new run folder."""
    root = Path(run).parent.parent
    text = (root / "run.toml").read_text()
    text = re.sub(r"^(pipeline_stages|partition_split) = .*\n", "", text, flags=re.M)
    text = re.sub(r"^\[sample\]\n(?:(?!\[).*\n?)*", "", text, flags=re.M)
    (root / "run1.toml").write_text(text)
    return train(root, "run1.toml", procs=1)


def assert_trains_on_one_stage_as_on_several(run: Path, steps: int, window: int) -> Path:
    """A multi-stage ``run``'s project trained again on 1 process (:func:`one_process_run`): its loss falls too
    (:func:`assert_loss_falls` over ``steps`` with ``window``), and ``run`` logged its losses and saved its LoRA
    (:func:`assert_trains_as`): what crossed the stage boundaries, and their gradients, came through unchanged.
    Returns the 1-process run."""
    one = one_process_run(run)
    assert_loss_falls(one, steps, window)
    assert_trains_as(run, one)
    return one


def assert_trained_in_stages(run: Path, steps: int, stages: int) -> list[float]:
    """The run logged ``steps`` finite losses and its last checkpoint holds one parameter file per pipeline stage (a
    short multi-stage run, too short for the loss to fall clearly). Returns the losses."""
    seq = losses(run)
    assert len(seq) == steps and all(math.isfinite(v) for v in seq), seq
    assert stage_files(run) == [f"params-stage{i}.safetensors" for i in range(stages)], stage_files(run)
    return seq


def checkpoint_params(run: Path) -> dict[str, torch.Tensor]:
    """The trainable tensors of the run's last checkpoint, all stages together (peft names, ``.default.``)."""
    ckpt = sorted((Path(run) / "checkpoints").glob("step-*"))[-1]
    params: dict[str, torch.Tensor] = {}
    for file in sorted(ckpt.glob("params-stage*.safetensors")):
        params.update(load_file(str(file)))
    return params


def stage_files(run: Path) -> list[str]:
    """The per-stage parameter files of the run's last checkpoint (one per pipeline stage)."""
    ckpt = sorted((Path(run) / "checkpoints").glob("step-*"))[-1]
    return sorted(p.name for p in ckpt.glob("params-stage*.safetensors"))


def write_saved_model(state: dict[str, torch.Tensor], folder: Path, stages: int = 2) -> Path:
    """``state`` as the core saves a full fine-tune over ``stages`` pipeline stages (``write_model_shards``): shards
    ``model-0000k-of-0000n.safetensors`` keyed by ``state_dict`` names, and their index. Returns ``folder``."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    keys, weight_map = sorted(state), {}
    for i in range(stages):
        shard = f"model-{i + 1:05d}-of-{stages:05d}.safetensors"
        part = keys[i * len(keys) // stages : (i + 1) * len(keys) // stages]
        save_file({k: state[k].contiguous() for k in part}, str(folder / shard))
        weight_map.update({k: shard for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def with_trained_lora(model: torch.nn.Module, run: Path, rank: int, alpha: float, targets: list[str]) -> Any:
    """``model`` (the untrained diffusion model) with peft LoRA on ``targets`` holding the trained tensors of the run's
    last checkpoint: the reference a saved adapter must reproduce."""
    apply_lora(model, lora_config(rank, alpha, 0.0, targets))
    missing, unexpected = model.load_state_dict(checkpoint_params(run), strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k], (unexpected[:3], missing[:3])
    return model.eval()


def assert_holds(params: dict[str, Any], names: tuple[str, ...], where: str) -> None:
    """Each of ``names`` is a tensor of ``params`` or a module some of its tensors belong to; a missing one is named
    with the closest names there are (modules and tensors)."""
    import difflib

    modules = {k.rsplit(".lora_", 1)[0] if ".lora_" in k else k.rsplit(".", 1)[0] for k in params}
    for name in names:
        if name in params or name in modules or any(k.startswith(name + ".") for k in params):
            continue
        close = difflib.get_close_matches(name, sorted(modules | set(params)), n=4, cutoff=0.5)
        raise AssertionError(
            f"{name} is neither a tensor nor a module of {where}'s {len(params)} tensors; closest: "
            + (", ".join(close) if close else f"none (e.g. {', '.join(sorted(params)[:3])})")
        )


def trained_transformer(
    model_class: Any, run: Path, model_dir: Path, rank: int, alpha: float, targets: list[str], trained: tuple[str, ...]
) -> Any:
    """The folder's untrained ``transformer`` (``model_class.from_pretrained``) with the run's trained LoRA tensors
    (:func:`with_trained_lora`), after checking that the last checkpoint holds each of ``trained``: a module name
    (``transformer_blocks.0.attn.to_q``: it has LoRA tensors) or a tensor's peft name."""
    assert_holds(checkpoint_params(run), trained, "the checkpoint")
    model = model_class.from_pretrained(str(Path(model_dir) / "transformer"))
    return with_trained_lora(model, run, rank, alpha, targets)


def read_saved_lora(
    saved: Path, rank: int, alpha: float, holding: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The diffusers-format LoRA a run saved in ``saved`` (e.g. ``saved/final``): its tensors and peft config, after
    checking the config's rank, that the trained ``alpha`` is folded in (alpha = rank in the config, the trained one
    in the file's metadata); with ``holding`` (keys without the ``transformer.`` prefix), that every key is the
    transformer's and those are among them."""
    from safetensors import safe_open

    from diffpipe_core.adapters import ADAPTER_FILE, read_adapter
    from diffpipe_core.engine.saving import TRAINED_ALPHA

    state, cfg = read_adapter(saved)
    assert cfg["r"] == rank and cfg["lora_alpha"] == rank, (cfg["r"], cfg["lora_alpha"])
    with safe_open(str(Path(saved) / ADAPTER_FILE), "pt") as f:
        assert float(f.metadata()[TRAINED_ALPHA]) == alpha, f.metadata()
    if holding:
        assert all(k.startswith("transformer.") for k in state), sorted(state)[:3]
        missing = [k for k in holding if f"transformer.{k}" not in state]
        assert not missing, f"{missing} not among the {len(state)} saved LoRA tensors"
    return state, cfg


def export_full_finetune(
    plugin: Any,
    model: torch.nn.Module,
    model_config: Any,
    saved: Path,
    formats: tuple[str, ...] = ("single_file", "diffusers"),
) -> dict[str, torch.Tensor]:
    """``model``'s weights saved in ``saved`` as the core saves a full fine-tune from one stage (shards and
    ``model.safetensors.index.json``), then exported by the plugin's ``export_model`` to ``saved/<format>`` in each of
    ``formats`` (each must write something). Returns the saved weights."""
    from diffpipe_core.engine.saving import write_model_shards

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    kw = {"rank": 0, "stage_id": 0, "dp_rank": 0, "num_stages": 1, "dtype": torch.float32}
    write_model_shards(saved, state, barrier=lambda: None, **kw)
    for fmt in formats:
        assert plugin.export_model(saved_dir=saved, model_config=model_config, out_dir=saved / fmt, format=fmt), fmt
    return state


def with_random_lora(model: torch.nn.Module, targets: list[str], rank: int = 4, alpha: float = 6.0) -> Any:
    """``model`` with a peft LoRA on ``targets`` whose tensors (``lora_B`` too) are drawn from ``normal(0, 0.1)`` by
    torch's global generator, so the adapter changes the output: what an export test converts."""
    apply_lora(model, lora_config(rank, alpha, 0.0, targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.1)
    return model


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def library_warnings(name: str = "diffusers") -> Iterator[list[str]]:
    """The warnings logger ``name`` logs inside the block (diffusers says "unexpected keys" when a LoRA misses)."""
    handler = _Collect()
    logging.getLogger(name).addHandler(handler)
    try:
        yield handler.messages
    finally:
        logging.getLogger(name).removeHandler(handler)


def load_lora_into(pipe: Any, lora_file: Path, adapter_name: str = "trained") -> list[str]:
    """``pipe.load_lora_weights(folder, weight_name=file)``; asserts every LoRA tensor of the file landed unchanged in
    the pipeline component its key prefix names (the diffusion model; trained text encoders) and nothing was left
    over. Returns diffusers' warnings."""
    from safetensors.torch import load_file as read

    with library_warnings() as warnings:
        pipe.load_lora_weights(str(lora_file.parent), weight_name=lora_file.name, adapter_name=adapter_name)
    # diffusers names keys it could not place ("unexpected keys", "missing keys"); its note that a pipeline's text
    # encoder got no LoRA keys is no problem for a LoRA of the diffusion model alone
    assert not [m for m in warnings if re.search(r"(unexpected|missing)( lora)? keys", m, re.I)], warnings
    state = read(str(lora_file))
    for prefix in sorted({k.split(".", 1)[0] for k in state}):
        model = getattr(pipe, prefix)
        loaded = {n.replace(f".{adapter_name}", ""): p for n, p in model.named_parameters() if "lora_" in n}
        file_keys = {k[len(prefix) + 1 :] for k in state if k.startswith(prefix + ".") and not k.endswith(".alpha")}
        assert set(loaded) == file_keys, (prefix, sorted(set(loaded) ^ file_keys)[:5])
        for key in file_keys:
            assert torch.equal(loaded[key].detach(), state[f"{prefix}.{key}"].float()), key
    return warnings


def assert_reproduces(got: torch.Tensor, expected: torch.Tensor, untrained: torch.Tensor, atol: float = 1e-5) -> None:
    """``got`` (a LoRA applied by another tool) equals ``expected`` (the trained model), and training visibly moved the
    output away from ``untrained`` (so a LoRA applied at the wrong strength or not at all cannot pass)."""
    err = (got - expected).abs().max()
    assert torch.allclose(got, expected, atol=atol), err
    assert (expected - untrained).abs().max() > 100 * max(float(err), 1e-7), "training did not change the output"


def assert_lora_reproduces(
    pipe: Any,
    lora_file: Path,
    reference: Callable[..., Any],
    inputs: dict[str, torch.Tensor],
    alpha: float | None = None,
) -> None:
    """The diffusers LoRA ``lora_file`` loaded into ``pipe`` with :func:`load_lora_into` makes ``pipe.transformer``
    give the trained model ``reference``'s outputs on ``inputs`` (and not the untrained ones); with ``alpha``, the
    adapter diffusers built has alpha = rank (the trained ``alpha`` is folded into the file's tensors)."""
    untrained = outputs(pipe.transformer, inputs)
    load_lora_into(pipe, lora_file)
    if alpha is not None:
        built = pipe.transformer.peft_config["trained"]
        assert built.lora_alpha == built.r, (built.lora_alpha, built.r)
    assert_reproduces(outputs(pipe.transformer, inputs), outputs(reference, inputs), untrained)


def merge_peft(base: dict[str, torch.Tensor], params: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``base`` (the model's weights) with the peft LoRA ``params`` (checkpoint names) merged:
    ``W += scale * B @ A``."""
    merged = dict(base)
    for name, lora_a in params.items():
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0]
            lora_b = params[name.replace(".lora_A.", ".lora_B.")]
            merged[f"{module}.weight"] = merged[f"{module}.weight"] + scale * lora_b @ lora_a
    return merged


def apply_comfyui(
    base: dict[str, torch.Tensor],
    comfy: dict[str, torch.Tensor],
    prefix: str = "diffusion_model",
    names: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """A ComfyUI-layout LoRA applied to original-layout weights as ComfyUI applies it:
    ``W += alpha / rows(lora_A) * lora_B @ lora_A`` per module (its ``.alpha`` is the only strength ComfyUI reads).
    ``names`` maps ComfyUI module names to the original ones where they differ."""
    out = dict(base)
    for key in comfy:
        if key.endswith(".lora_A.weight"):
            comfy_module = key[len(prefix) + 1 : -len(".lora_A.weight")]
            module = (names or {}).get(comfy_module, comfy_module)
            down, up = comfy[key], comfy[f"{prefix}.{comfy_module}.lora_B.weight"]
            scale = float(comfy[f"{prefix}.{comfy_module}.alpha"]) / down.shape[0]
            out[f"{module}.weight"] = out[f"{module}.weight"] + scale * up @ down
    return out


def assert_state_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))[:5]
    for key in expected:
        assert torch.allclose(got[key], expected[key], atol=atol), key


def outputs(model: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model(**inputs).sample`` without gradients."""
    with torch.no_grad():
        return model(**inputs).sample
