"""Leave a process without tearing down the libraries it imported.

After a run, Python's interpreter shutdown frees every module of torch, DeepSpeed, diffusers, peft and
transformers one by one: about 3.5 s of CPU per process on 2 cores, for nothing. The work is saved and the
files are closed by then, so the processes diffpipe starts end with ``os._exit`` instead.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_now(code: int | None, run_atexit: bool = True) -> NoReturn:
    """Flush stdout and stderr, run the ``atexit`` callbacks (not in a forked child: those belong to its parent,
    which for one deletes the folder the workers report errors to), then end the process with ``code``."""
    if run_atexit:
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or gone (the reader of a pipe left): nothing more to say
    os._exit(code if isinstance(code, int) else 1)
