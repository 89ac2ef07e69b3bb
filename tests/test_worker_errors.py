"""Issue 20.11: a decode worker killed while caching is reported in one line (its traceback only with --debug).
The worker is a real DataLoader worker of the real caching path, killed with SIGKILL from the encoder."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import traceback
from pathlib import Path

import pytest
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

import diffpipe_reference.plugin as reference_plugin
from diffpipe_core import hookimpl
from diffpipe_core.data import prepare_cache
from diffpipe_core.engine.worker import describe_failure
from diffpipe_core.registry import Registry
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_reference.model import write_tiny_model


class KillsDecoders:
    """Kills the decode workers while the first media batch is encoded; ``handing_over``: once the next batch's
    tensors are in the worker's result queue (an event, not a delay), so the main process takes them from a dead
    worker, whose connection is refused or reset (what a loaded machine showed)."""

    def __init__(self, handing_over: bool) -> None:
        self.handing_over = handing_over

    @hookimpl(wrapper=True)
    def encode_batch(self, encoders, batch):
        if batch.pixels is not None:
            if self.handing_over:
                (loader,) = [o for o in gc.get_objects() if type(o) is _MultiProcessingDataLoaderIter
                             and any(w.is_alive() for w in o._workers)]
                assert loader._worker_result_queue._reader.poll(120), "the next batch never came"
            for child in multiprocessing.active_children():  # the DataLoader's decode workers
                os.kill(child.pid, signal.SIGKILL)
        return (yield)


@pytest.mark.parametrize("handing_over", [False, True], ids=["decoding", "handing-over"])
def test_a_killed_decode_worker_is_one_line(tmp_path: Path, handing_over: bool) -> None:
    write_image_dataset(tmp_path / "data", 6, size=(64, 64))
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "data", resolutions=[64])
    registry = Registry()
    registry.register_model("reference", reference_plugin)
    registry.register_generic("killer", KillsDecoders(handing_over))
    plugin = registry.model("reference")
    config = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp_path / "model"))
    with pytest.raises(RuntimeError) as info:
        prepare_cache(toml, plugin, config, batch_size=1, decode_workers=1, progress=False)
    assert len("".join(traceback.format_exception(info.value)).splitlines()) > 10  # what torch gives
    message, detail = describe_failure(info.value, debug=False)
    assert message.startswith("a decode worker died: DataLoader worker ") and "\n" not in message, message
    assert "caching resumes where it stopped" in message and detail == ""
    assert "Traceback" in describe_failure(info.value, debug=True)[1]
