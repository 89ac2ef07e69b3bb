"""``diffpipe train --resume``: which run and checkpoint, whether the edited config can continue it, and whether
there is anything left to train; decided before any worker starts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diffpipe_core.engine import config_changes
from diffpipe_core.engine.checkpoint import read_train_state
from diffpipe_core.engine.run_dir import Resume, resolve_resume
from diffpipe_core.engine.run_lock import hold_run_folder
from diffpipe_core.schema import ConfigError

# the keys that decide how many steps a run has (besides the number of processes, for epoch-based runs)
_LENGTH_KEYS = ("max_steps", "epochs", "micro_batch_size_per_gpu", "gradient_accumulation_steps", "dataset")


def prepare_resume(
    cfg: Any, resume: str, num_procs: int, say: Callable[[str], None], primary: bool = True,
    reset_optimizer: bool = False,
) -> Resume | None:
    """The checkpoint to resume from (having said which and why), or None when the run is already finished.

    Holds the run folder (:mod:`diffpipe_core.engine.run_lock`): another live writer is refused. Raises ConfigError
    listing each changed key that cannot apply to the checkpoint; records the new config in
    the run folder when some changed key does apply (``primary``: this process does the writing and the saying,
    not the other ranks an external launcher started). ``reset_optimizer``: the optimizer starts fresh, so its type
    may change."""
    if not primary:
        say = _silent
    chosen = resolve_resume(cfg.run.output_dir, resume)
    if primary:
        hold_run_folder(chosen.run_dir)  # before anything in it is read for the decision or written
    for note in chosen.notes:
        say(f"diffpipe: {note}")
    state = read_train_state(chosen.checkpoint)
    step = int(state["step"])
    saved = config_changes.saved_config(chosen.run_dir)
    new = config_changes.resolved_dump(cfg)
    applied: list[str] = []
    if saved is not None:
        refused, applied = config_changes.review(saved, new, step, reset_optimizer)
        if refused:
            raise ConfigError([f"{cfg.path}: {line}" for line in refused])
    if _finished(cfg, state, saved, num_procs):
        say(
            f"diffpipe: run {chosen.run_dir} is finished: its checkpoint {chosen.checkpoint.name} is step {step} of "
            f"{state.get('total_steps')}; nothing to train, nothing changed (raise max_steps or epochs to go on)"
        )
        return None
    for line in applied:
        say(f"diffpipe: config changed since the checkpoint: {line}")
    if applied and primary:
        config_changes.record(chosen.run_dir, cfg.path.read_text(), new, step)
    say(f"diffpipe: resuming run {chosen.run_dir} from step {step} ({chosen.checkpoint.name})")
    return chosen


def _finished(cfg: Any, state: dict[str, Any], saved: dict[str, Any] | None, num_procs: int) -> bool:
    step, total = int(state["step"]), state.get("total_steps")
    if cfg.run.max_steps is not None:
        return step >= cfg.run.max_steps
    if total is None or saved is None or state.get("world_size") != num_procs:
        return False  # the trainer decides once it knows the dataset's size
    same = all(saved.get("run", {}).get(k) == config_changes.resolved_dump(cfg)["run"].get(k) for k in _LENGTH_KEYS)
    return same and step >= int(total)



def _silent(_line: str) -> None:
    pass
