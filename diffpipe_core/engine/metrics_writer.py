"""Where rank 0's scalars and sample images go: TensorBoard (``<run>/tensorboard``) and, with ``[logging] wandb``,
Weights & Biases.

:class:`MetricsWriter` has the three methods the trainer, the evaluation and the sampling code call on a
TensorBoard ``SummaryWriter`` (``add_scalar``, ``add_image``, ``flush``) plus ``close``, and sends each call to
every sink, so none of them knows about W&B. The W&B run gets the resolved config (``resolved_config.json``) and
keeps its id in ``<run>/wandb/run_id``, so a resumed training continues the same W&B run. wandb is optional
(``pip install diffpipe-core[wandb]``); its own messages stay behind ``--verbose``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from diffpipe_core.atomic import atomic_write_text
from diffpipe_core.config import WandbConfig
from diffpipe_core.quiet import verbose

WANDB_DIR = "wandb"
RUN_ID = "run_id"


class MetricsWriter:
    """Fans ``add_scalar`` / ``add_image`` / ``add_audio`` / ``flush`` / ``close`` out to TensorBoard and an optional
    W&B run."""

    def __init__(self, tensorboard: Any, wandb_run: Any = None) -> None:
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.tensorboard.add_scalar(tag, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({tag: value}, step=step)

    def add_image(self, tag: str, image: Any, step: int, dataformats: str = "CHW") -> None:
        self.tensorboard.add_image(tag, image, step, dataformats=dataformats)
        if self.wandb_run is not None:
            import numpy as np
            import wandb

            array = np.asarray(image)
            if dataformats == "CHW":
                array = array.transpose(1, 2, 0)
            self.wandb_run.log({tag: wandb.Image(array)}, step=step)

    def add_audio(self, tag: str, audio: Any, step: int, sample_rate: int) -> None:
        """A sample's sound: ``(1, S)`` float in [-1, 1] (mono) to TensorBoard's audio tab and W&B's ``wandb.Audio``."""
        self.tensorboard.add_audio(tag, audio, step, sample_rate=sample_rate)
        if self.wandb_run is not None:
            import numpy as np
            import wandb

            self.wandb_run.log({tag: wandb.Audio(np.asarray(audio).reshape(-1), sample_rate=sample_rate)}, step=step)

    def flush(self) -> None:
        self.tensorboard.flush()

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def open_writer(run_dir: Path, wandb_cfg: WandbConfig | None) -> MetricsWriter:
    """Rank 0's writer for a run folder: TensorBoard always, W&B when ``[logging] wandb`` is set."""
    from torch.utils.tensorboard import SummaryWriter

    tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    return MetricsWriter(tensorboard, start_wandb(run_dir, wandb_cfg) if wandb_cfg is not None else None)


def start_wandb(run_dir: Path, cfg: WandbConfig) -> Any:
    """A W&B run for ``run_dir`` (the same one again when the training resumes), with the resolved config."""
    try:
        import wandb
    except ImportError:
        raise ValueError(
            "logging.wandb: the wandb package is not installed; pip install 'diffpipe-core[wandb]' (or remove "
            "[logging] wandb)"
        ) from None
    folder = run_dir / WANDB_DIR
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / RUN_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    atomic_write_text(id_file, run_id)
    resolved = run_dir / "resolved_config.json"
    config = json.loads(resolved.read_text()) if resolved.is_file() else {}
    mode = cfg.mode or os.environ.get("WANDB_MODE") or "online"
    quiet = not verbose()
    settings = wandb.Settings(silent=quiet, console="off", show_info=not quiet, show_warnings=not quiet)
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name or run_dir.name,
        group=cfg.group,
        tags=cfg.tags or None,
        notes=cfg.notes,
        config=config,
        dir=str(folder),
        id=run_id,
        resume="allow" if mode == "online" else None,
        mode=mode,
        settings=settings,
    )
