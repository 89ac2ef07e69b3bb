"""Wan Fun-Control end to end through the real CLI (DeepSpeed on gloo, the real cache, peft), on one short run: the
clips and control videos of the VACE run's project (``test_wan_vace_train.make_project``), 1 stage in 1 process; the
loss falls, the control latents are cached per clip, and the LoRA, loaded with ``WanPipeline.load_lora_weights``,
reproduces the trained transformer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_wan_vace_train import ALPHA, RANK, make_project

from diffpipe_core.testing import runs
from diffpipe_wan.testing import write_tiny_wan_fun

pytestmark = pytest.mark.slow

STEPS = 24
MODEL = {"type": "wan-fun", "text_max_length": 8, "timestep_sample_method": "uniform", "min_t": 0.8}


@pytest.fixture(scope="module")
def fun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wan-fun-run")
    project = make_project(root, MODEL, write_tiny_wan_fun, STEPS)
    return runs.train(root, project, procs=1, timeout=600, OMP_NUM_THREADS="1")


def test_loss_falls_and_the_control_latents_are_cached(fun_run: Path) -> None:
    from diffpipe_core.data.cache_store import list_shards

    runs.assert_loss_falls(fun_run, STEPS, 6)
    cache = fun_run.parent.parent / "cache"
    shards = [s for folder in cache.rglob("controls") for s in list_shards(folder)]
    assert shards and all(s.columns["latents"][0] == (4, 2, 4, 4) for s in shards), [s.columns for s in shards]


def test_lora_loads_in_wan_pipeline_and_reproduces(fun_run: Path) -> None:
    from diffusers import WanPipeline, WanTransformer3DModel

    saved = fun_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    model = fun_run.parent.parent / "model"
    fresh = WanTransformer3DModel.from_pretrained(str(model / "transformer"))
    reference = runs.with_trained_lora(fresh, fun_run, RANK, ALPHA, cfg["target_modules"])
    pipe = WanPipeline.from_pretrained(str(model), local_files_only=True)
    g = torch.Generator().manual_seed(2)
    inputs = {"hidden_states": torch.randn(2, 12, 2, 4, 4, generator=g), "timestep": torch.rand(2, generator=g) * 1000,
              "encoder_hidden_states": torch.randn(2, 8, 32, generator=g)}
    untrained = runs.outputs(pipe.transformer, inputs)
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    got, expected = runs.outputs(pipe.transformer, inputs), runs.outputs(reference, inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    runs.assert_reproduces(got, expected, untrained)
