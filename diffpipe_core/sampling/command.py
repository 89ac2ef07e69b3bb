"""``diffpipe sample``: generate with the base model plus a saved adapter, without training.

Imports only click at module level (every ``diffpipe`` command imports this module); the work happens in
the same worker processes as training, through a pipeline engine built by the same stage builder, without the
dataset, its cache or an optimizer.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click


@click.command("sample")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="The run config (TOML).")
@click.option("--model", default=None, help="Model plugin name; defaults to [model] type in the config.")
@click.option(
    "--adapter",
    type=click.Path(path_type=Path),
    default=None,
    help="A saved adapter folder (e.g. a run's saved/final); default: the base model alone.",
)
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeat for several); default: [sample] prompts.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("samples"),
    show_default=True,
    help="A folder (it gets NN-<prompt>.png, or .mp4 for video models, per prompt, contact-sheet.png, "
    "latents.safetensors and prompts.json), or for one prompt a .png (.mp4) file.",
)
@click.option("--steps", type=int, default=None, help="Denoising steps (default: [sample] steps, else 20).")
@click.option("--seed", type=int, default=None, help="Noise seed (default: [sample] seed, else 0).")
@click.option("--num-procs", type=int, default=None, help="Worker processes (default: one per GPU, else 1).")
def sample(
    config_path: Path,
    model: str | None,
    adapter: Path | None,
    prompts: tuple[str, ...],
    out: Path,
    steps: int | None,
    seed: int | None,
    num_procs: int | None,
) -> None:
    """Generate samples from the base model plus a saved adapter, through the pipeline (any number of processes).

    Settings not given here (resolution, guidance, cfg, negative prompt, frames) come from the config's
    [sample] table (its every_n_* keys are not needed); the size defaults to the dataset's first resolution and
    frame bucket. Needs only the model, the adapter and prompts: no dataset media, no cache.

    \b
    A folder --out gets, as a training sampling point's samples/step-N/ does:
      NN-<prompt>.png        one per prompt (video models: NN-<prompt>.mp4)
      contact-sheet.png      every sample in a grid, the prompt under each
      latents.safetensors    sample_NN: prompt NN's final latents, before decoding
      prompts.json           which file shows which prompt; size, steps, cfg, seed
    Prompt NN's noise comes from torch.Generator().manual_seed(seed * 1_000_003 + NN): the manual's
    samples page gives the diffusers call that reproduces a sample.
    """
    from diffpipe_core.cli_common import fail, load_checked
    from diffpipe_core.engine.fast_exit import exit_now
    from diffpipe_core.engine.launcher import default_num_procs, launch_workers
    from diffpipe_core.registry import get_registry
    from diffpipe_core.sampling.config import dataset_shape, missing_sampling_hooks
    from diffpipe_core.schema import ConfigError

    n = default_num_procs(num_procs)
    cfg = load_checked(config_path, model, n if num_procs is not None else None, purpose="sample")
    stages = cfg.run.pipeline_stages
    if num_procs is None and n % stages:  # sampling needs no pipeline: the whole model on each process
        click.echo(
            f"diffpipe: sampling on {n} process{'es' if n > 1 else ''} with the whole model; pipeline_stages = "
            f"{stages} would need a multiple of {stages} processes (--num-procs {stages} samples through the "
            f"{stages}-stage pipeline)"
        )
        stages = 1
    problems = []
    try:
        dataset_shape(cfg.run.dataset, get_registry().model(cfg.model_name).spec)  # only for the default size
    except ConfigError as exc:
        problems.extend(exc.problems)
    missing = missing_sampling_hooks(get_registry().model(cfg.model_name))
    if missing:
        problems.append(f"model plugin {cfg.model_name!r} cannot sample: it does not implement {', '.join(missing)}")
    if not prompts and cfg.run.sample is None:
        problems.append(f"{cfg.path}: no prompts: give --prompt, or add a [sample] table with prompts")
    if adapter is not None and not (adapter / "adapter_model.safetensors").is_file() and not adapter.is_file():
        problems.append(f"--adapter {adapter}: no adapter_model.safetensors there (give a saved adapter folder)")
    suffix = ".mp4" if get_registry().model(cfg.model_name).spec.modality == "video" else ".png"
    if out.suffix.lower() in (".png", ".mp4") and out.suffix.lower() != suffix:
        problems.append(f"--out {out}: model {cfg.model_name!r} makes {suffix} files")
    if out.suffix.lower() in (".png", ".mp4") and len(prompts) > 1:
        problems.append(f"--out {out}: one file but {len(prompts)} prompts; give a folder")
    if problems:
        fail(problems)
    request = {
        "prompts": list(prompts) or None,
        "adapter": str(adapter.resolve()) if adapter is not None else None,
        "out": str(out.resolve()),
        "steps": steps,
        "seed": seed,
        "pipeline_stages": stages,
    }
    with tempfile.TemporaryDirectory(prefix="diffpipe-sample-") as tmp:
        request_file = Path(tmp) / "request.json"
        request_file.write_text(json.dumps(request))
        args = ["--config", str(cfg.path), "--model", cfg.model_name]
        code = launch_workers([*args, "--sample-request", str(request_file)], n)
    exit_now(code)
