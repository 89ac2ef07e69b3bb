"""Per-stage loading, checked on the real weight-file readers: each pipeline stage reads from the weight files only
the tensors of its own layers (a fused tensor only where it holds one of its parts), and gets exactly the weights a
whole load gives.

    assert_stages_read_their_own(plugin, model_config, stages=2)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

import diffpipe_core.engine.model_loading as model_loading
from diffpipe_core.engine.partition import stage_parts
from diffpipe_core.weight_files import open_weights


class CountingReader:
    """The real weight-file reader (safetensors' own, or the GGUF one), recording the keys whose tensors are read."""

    def __init__(self, reads: list[str], handle: Any) -> None:
        self.handle, self.reads = handle, reads

    def keys(self) -> list[str]:
        return self.handle.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        self.reads.append(key)
        return self.handle.get_tensor(key)


def counting(reads: list[str]) -> Any:
    """:func:`~diffpipe_core.weight_files.open_weights`, its reads recorded in ``reads``."""

    @contextmanager
    def opened(*args: Any, **kwargs: Any) -> Iterator[CountingReader]:
        with open_weights(*args, **kwargs) as handle:
            yield CountingReader(reads, handle)

    return opened


@dataclass
class StageRead:
    """One stage's per-stage load: the file keys it read (in order, repeats kept) and the tensors it filled."""

    reads: list[str]
    tensors: dict[str, torch.Tensor]


def load_stages(plugin: Any, model_config: Any, stages: int = 2) -> list[StageRead]:
    """Load the model per stage, as ``stages`` ranks would (split by parameter count), counting the reads."""
    device = torch.device("cpu")
    out = []
    for stage_id in range(stages):
        reads: list[str] = []
        stage = model_loading.load_for_stages(plugin, model_config, device, torch.float32)
        assert stage.per_stage_loading, f"model {plugin.name!r} does not implement diffusion_model_weights"
        assert all(p.device.type == "meta" for p in stage.model.parameters()), "the skeleton holds real tensors"
        parts = stage_parts(stage.layers, stages)
        with mock.patch.object(model_loading, "open_weights", counting(reads)):
            model_loading.materialise_layers(
                plugin, model_config, stage, range(parts[stage_id], parts[stage_id + 1]), device
            )
        real = {n: t for n, t in stage.model.state_dict().items() if t.device.type != "meta"}
        out.append(StageRead(reads, real))
    return out


def assert_stages_read_their_own(plugin: Any, model_config: Any, stages: int = 2) -> list[StageRead]:
    """Every stage's tensors equal a whole load's; the stages' tensors are disjoint and together the whole model; each
    file key is read at most once, by one stage. Returns the per-stage reads for model-specific checks."""
    whole = plugin.require(
        "load_diffusion_model", model_config=model_config, device=torch.device("cpu"), dtype=torch.float32
    ).state_dict()
    loaded = load_stages(plugin, model_config, stages)
    seen: set[str] = set()
    read_by: set[str] = set()
    for i, stage in enumerate(loaded):
        assert stage.tensors, f"stage {i} loaded nothing"
        for name, tensor in stage.tensors.items():
            assert torch.equal(tensor, whole[name]), f"stage {i}: {name} differs from a whole load"
        assert not seen & set(stage.tensors), f"stages share tensors: {sorted(seen & set(stage.tensors))[:3]}"
        seen |= set(stage.tensors)
        assert len(stage.reads) == len(set(stage.reads)), f"stage {i} read a key twice"
        assert not read_by & set(stage.reads), f"two stages read {sorted(read_by & set(stage.reads))[:3]}"
        read_by |= set(stage.reads)
    assert seen == set(whole), f"tensors no stage loaded: {sorted(set(whole) - seen)[:3]}"
    return loaded
