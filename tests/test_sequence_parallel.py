"""Ulysses sequence parallelism (diffpipe_core/engine/sequence_parallel.py): the attention through DeepSpeed's
all-to-all equals the attention over the whole sequence, outputs and gradients, in 2 gloo processes; the up-front
refusals. The training runs (losses and saved LoRA equal to sequence_parallel = 1) are in the Wan and HunyuanVideo
plugins' tests."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from diffpipe_core.config import ConfigError, check_world_size
from diffpipe_core.engine.launcher import free_port, local_rank_env
from diffpipe_core.engine.sequence_parallel import UlyssesConfig, check_heads, sequence_problems, shard
from diffpipe_core.engine.stage_build import Layout
from diffpipe_core.testing import processes
from diffpipe_core.testing.processes import cli_env

WORKER = Path(__file__).with_name("sequence_parallel_worker.py")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ulysses_attention_equals_whole_sequence_attention_with_joint_text(tmp_path: Path) -> None:
    port, world = free_port(), 2
    envs = [cli_env([REPO], **local_rank_env(rank, world, port), OMP_NUM_THREADS="1") for rank in range(world)]
    codes = processes.run_ranks([sys.executable, str(WORKER), str(tmp_path)], envs, tmp_path, timeout=90)
    logs = "\n".join((tmp_path / f"log{r}.txt").read_text()[-3000:] for r in range(world))
    assert codes == [0, 0], logs
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    ref, ref_grads = results[0]["ref"], results[0]["ref_grads"]
    s = ref.shape[1] - 3  # 3 replicated text tokens after the video ones
    n = s // world
    for rank, res in enumerate(results):
        assert res["calls"] == 1
        mine = slice(rank * n, (rank + 1) * n)
        torch.testing.assert_close(res["out"][:, :n], ref[:, mine])
        torch.testing.assert_close(res["out"][:, n:], ref[:, s:])  # every rank has the whole text output
        for got, want in zip(res["video_grads"], ref_grads, strict=True):
            torch.testing.assert_close(got, want[:, mine])
    for i, want in enumerate(ref_grads):  # a replicated tensor's gradient: the ranks' shares add up to it
        torch.testing.assert_close(sum(res["text_grads"][i] for res in results), want[:, s:])


class _Attention(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        self.processor = WanAttnProcessor()


class BlockLayer(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.attn = _Attention(heads)


class _Spec:
    name, block_layers, sequence_tensors = "tiny", ("BlockLayer",), ((0, 1),)


def test_heads_not_divisible_are_refused_naming_the_count() -> None:
    layers = [nn.Identity(), BlockLayer(6), nn.Identity()]
    assert sequence_problems(2, layers, _Spec) == []
    (problem,) = sequence_problems(4, layers, _Spec)
    assert "sequence_parallel = 4" in problem and "6 attention heads" in problem and "Valid: 1, 2, 3, 6" in problem

    class Bare:
        name, block_layers, sequence_tensors = "bare", ("BlockLayer",), ()

    assert "ModelSpec.sequence_tensors" in sequence_problems(2, layers, Bare)[0]
    layers[1].attn.processor = object()  # an attention that calls SDPA itself
    with pytest.raises(ValueError, match="does not pass a parallel config"):
        check_heads(2, [("layer 1: attn", layers[1].attn)], "tiny")


def test_a_token_count_the_ranks_do_not_divide_is_named_with_the_keys_that_set_it() -> None:
    """A micro-batch's or a [sample]'s latents (the sampling forward runs the same split blocks)."""
    config = UlyssesConfig(group=None, size=2, rank=1)
    torch.testing.assert_close(shard(torch.arange(8.0).view(1, 4, 2), 1, config), torch.tensor([[[4.0, 5], [6, 7]]]))
    with pytest.raises(ValueError, match=r"has 5 tokens along dimension 1 .* which 2 does not divide") as err:
        shard(torch.zeros(1, 5, 2), 1, config)
    assert "frame buckets and resolutions (and [sample] resolution and frames)" in str(err.value)


def test_layout_orders_stage_replica_sequence_rank() -> None:
    places = [(lay.stage_id, lay.dp_rank, lay.seq_rank, lay.replica)
              for lay in (Layout(r, 8, 2, 2) for r in range(8))]
    assert places == [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 2), (0, 1, 1, 3),
                      (1, 0, 0, 0), (1, 0, 1, 1), (1, 1, 0, 2), (1, 1, 1, 3)]
    assert Layout(5, 8, 2, 2).dp == 2 and Layout(5, 8, 2, 2).replicas == 4


def test_world_size_must_be_a_multiple_of_stages_times_sequence_ranks() -> None:
    run = SimpleNamespace(pipeline_stages=2, sequence_parallel=2)
    check_world_size(run, 8, "run.toml")
    with pytest.raises(ConfigError, match=r"pipeline_stages \(2\) x sequence_parallel \(2\) = 4 does not divide"):
        check_world_size(run, 6, "run.toml")


def test_the_plan_splits_the_block_layers_activations_per_sequence_rank() -> None:
    from diffpipe_core.engine.activations import LayerTensors
    from diffpipe_core.engine.plan_build import sequence_split_costs
    from diffpipe_core.engine.stage_costs import LayerCost, ModelCosts

    def cost(name: str, block: bool) -> LayerCost:
        tensors = LayerTensors(saved={1: 1000, 2: 10}, inputs={3: 400}, outputs={4: 400})
        return LayerCost(name, 10, 40, 0, block, 0, 0, tensors)

    costs = ModelCosts([cost("EmbedLayer", False), cost("BlockLayer", True), cost("HeadLayer", False)], True)
    split = sequence_split_costs(costs, 4)
    assert [c.tensors.saved for c in split.layers] == [{1: 1000, 2: 10}, {1: 250, 2: 3}, {1: 1000, 2: 10}]
    assert split.layers[1].tensors.inputs == {3: 100} and split.layers[1].tensors.outputs == {4: 100}
    assert costs.layers[1].tensors.saved == {1: 1000, 2: 10}  # the measured costs are left as they were
