"""Keep the libraries' own chatter out of what a user reads; ``--verbose`` (``DIFFPIPE_VERBOSE=1``) shows it.

Users see diffpipe's lines and the warnings that concern them (a file left out, a non-finite loss). What the
libraries print about themselves (bitsandbytes' optional CPU kernels, DeepSpeed's accelerator detection,
layer seeds and topology, transformers' and diffusers' advisory warnings) goes away unless asked for.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator

VERBOSE_ENV = "DIFFPIPE_VERBOSE"

# Library loggers whose info and warnings are about the library itself, not the user's run.
LIBRARY_LOGGERS = ("bitsandbytes", "DeepSpeed", "transformers", "diffusers", "torch.distributed.elastic")
# Warnings that concern diffpipe's own use of a library, never something the user can change.
LIBRARY_WARNINGS = (
    # diffpipe steps the optimizer through its own guard (clipping, non-finite check), which hides the call
    # from the scheduler's step counter
    r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`",
    r"Seems like `optimizer\.step\(\)` has been overridden after learning rate scheduler initialization",
    r".*torchvision.*",
    # diffusers' audio VAEs (MiniMax H3's among them) build their layers with torch's older weight_norm
    r"`torch\.nn\.utils\.weight_norm` is deprecated",
)


def verbose() -> bool:
    """Whether the user asked for the libraries' messages (``diffpipe --verbose``)."""
    return bool(os.environ.get(VERBOSE_ENV))


def quiet_libraries(cuda: bool | None = None) -> None:
    """Silence library chatter for this process and the processes it starts (call before importing them).

    ``cuda``: whether a GPU will be used; False lets DeepSpeed skip the accelerator detection whose only output
    is a warning that none was found. A no-op with ``--verbose``.
    """
    if verbose():
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars follow it
    if cuda is False:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for pattern in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def quiet_script() -> None:
    """What the ``diffpipe`` commands do about library chatter, for a script that imports the libraries itself
    (the tiny-model writers of the demo and tests, the benches): call it first, before diffusers, transformers,
    DeepSpeed or bitsandbytes are imported. A no-op with ``DIFFPIPE_VERBOSE=1``."""
    import torch

    quiet_libraries(cuda=torch.cuda.is_available())


@contextlib.contextmanager
def library_prints() -> Iterator[None]:
    """Swallow what a library ``print``s to stdout inside the block (DeepSpeed's ``SEED_LAYERS=...`` and
    ``Using topology``), unless verbose. Errors still propagate."""
    if verbose():
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield
    sys.stdout.flush()


class _BarSafeHandler(logging.Handler):
    """Writes log records with ``tqdm.write``: a warning printed while a progress bar is drawn (a model plugin's,
    during caching) gets its own line instead of landing inside the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def log_through_bars() -> None:
    """Route warnings (what Python's last-resort handler would print) through :class:`_BarSafeHandler`, once."""
    root = logging.getLogger()
    if not any(isinstance(h, _BarSafeHandler) for h in root.handlers):
        handler = _BarSafeHandler(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
