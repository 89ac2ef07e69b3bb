"""Issue 20.20 and 20.21: one option name for regenerating the cache; a warning logged while a bar is drawn (Cosmos
warns about untrained sizes while caching) gets its own line."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from diffpipe_core.cli import main
from diffpipe_core.quiet import log_through_bars


def test_cache_and_train_call_regenerating_the_cache_the_same() -> None:
    for command in ("cache", "train"):
        options = {o for p in main.commands[command].params for o in p.opts}
        assert "--regenerate-cache" in options and "--regenerate" not in options, (command, options)


def test_a_warning_during_a_progress_bar_starts_its_own_line(capsys) -> None:
    log_through_bars()
    bar = tqdm(total=4, desc="caching", file=sys.stderr)
    bar.update(1)
    logging.getLogger("diffpipe_cosmos.encoding").warning("size 9x64x64 was not in the released checkpoints' training")
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    at = err.index("size 9x64x64")
    assert err[at - 1] in "\r\n", repr(err[max(0, at - 40) : at + 20])  # not glued to the bar's text
    assert err.count("size 9x64x64") == 1
