"""Block swap and activation checkpointing wrappers on the reference model's layers, in one process.

On CPU the swap moves nothing, but the same code runs; these tests check the sequencing (a swapped block's
weights are in place whenever its forward, its recomputation or its backward runs, and dropped after) and that
outputs and gradients are those of the plain layers. The multi-process runs are in test_train_memory.py.
"""

from __future__ import annotations

import pytest
import torch

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.memory import CheckpointedLayer, SwappedBlock, wrap_stage_layers
from diffpipe_reference.layers import split_into_layers
from diffpipe_reference.model import TinyDiT, TinyDiTConfig

CPU = torch.device("cpu")


def lora_model() -> tuple[TinyDiT, list[torch.nn.Module]]:
    torch.manual_seed(0)
    model = TinyDiT(TinyDiTConfig(dim=32, depth=4, heads=2))
    model.requires_grad_(False)
    apply_lora(model, lora_config(4, 4, 0.0, ["to_q", "fc1"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return model, split_into_layers(model)


def run(
    layers: list[torch.nn.Module], model: TinyDiT, device: torch.device = CPU
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and LoRA gradients of one seeded batch through ``layers`` on ``device`` (returned on the CPU)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 4, 16, 16, generator=g), torch.rand(2, generator=g), torch.randn(2, 16, 32, generator=g))
    x = tuple(t.to(device) for t in x)
    for layer in layers:
        x = layer(x)
    loss = x[0].square().mean()
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().cpu(), grads


@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_wrapped_layers_give_the_plain_loss_and_gradients(checkpointing: bool | str) -> None:
    model, layers = lora_model()
    plain_loss, plain_grads = run(layers, model)
    wrapped, swapped = wrap_stage_layers(layers, range(len(layers)), ("BlockLayer",), checkpointing, 3, CPU)
    assert swapped == 3 and [type(w).__name__ for w in wrapped[2:5]] == ["SwappedBlock"] * 3
    if checkpointing:
        assert isinstance(wrapped[1], CheckpointedLayer) and isinstance(wrapped[2].layer, CheckpointedLayer)
    loss, grads = run(wrapped, model)
    assert loss == plain_loss
    assert grads.keys() == plain_grads.keys() and len(grads) == 16
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_swapped_blocks_weights_are_in_place_whenever_it_computes() -> None:
    model, layers = lora_model()
    wrapped, _ = wrap_stage_layers(layers, range(len(layers)), ("BlockLayer",), True, 2, CPU)
    swapped = [w for w in wrapped if isinstance(w, SwappedBlock)]
    swapper = swapped[0].swapper
    seen: list[str] = []

    def check(block: SwappedBlock, when: str) -> None:
        assert swapper.blocks[block.index].loaded, f"block {block.index} computed its {when} without its weights"
        seen.append(f"{when} {block.index}")

    for block in swapped:
        inner = block.layer.layer.block  # SwappedBlock(CheckpointedLayer(BlockLayer)).block
        inner.register_forward_pre_hook(lambda m, a, b=block: check(b, "forward"))
        lora_a = inner.attn.to_q.lora_A["default"].weight
        lora_a.register_hook(lambda g, b=block: check(b, "backward"))
    run(wrapped, model)
    # forward, the recomputation of each checkpointed block in backward (last block first), its gradient
    assert seen == ["forward 0", "forward 1", "forward 1", "backward 1", "forward 0", "backward 0"]
    assert not any(b.loaded for b in swapper.blocks), "weights were not dropped after backward"


def test_swapped_weights_stay_out_of_module_to() -> None:
    model, layers = lora_model()
    wrapped, _ = wrap_stage_layers(layers, range(len(layers)), ("BlockLayer",), False, 1, CPU)
    block = wrapped[4]
    frozen = block.swapper.blocks[0].params
    lora = [p for p in block.parameters() if p.requires_grad]
    block.to(torch.float64)
    assert all(p.dtype == torch.float32 for p in frozen), "module.to() reached a swapped weight"
    assert lora and all(p.dtype == torch.float64 for p in lora), "module.to() must still move the LoRA weights"
    assert all(any(p is q for q in block.parameters()) for p in frozen), "swapped weights left the module"


class _PassThrough(torch.nn.Module):
    """A block that hands one of its inputs (``context``, needing no gradient) on unchanged, as Wan's and
    HunyuanVideo's block layers hand on the text tokens and the rotary embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.attend = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.proj.requires_grad_(False)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, context = inputs
        return hidden + self.attend(self.proj(context)), context


def test_a_checkpointed_block_ending_a_stage_recomputes_what_its_forward_saved() -> None:
    """The stage boundary (OutputsRequireGrad) makes a handed-on tensor require a gradient; it must not do so on the
    block's own input object, which the checkpoint keeps for the recomputation: the recomputation would then save
    what the forward did not (torch's CheckpointError, the cause of sequence_parallel x activation_checkpointing
    runs failing on 2 stages)."""
    from diffpipe_core.engine.ds_patches import OutputsRequireGrad

    torch.manual_seed(0)
    block = _PassThrough()
    hidden, context = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 3, 4)
    plain = block((hidden, context))
    want = torch.autograd.grad(plain[0].sum(), [hidden, block.attend.weight])
    out = OutputsRequireGrad(CheckpointedLayer(block, offload=False))((hidden, context))
    got = torch.autograd.grad(out[0].sum(), [hidden, block.attend.weight])
    assert out[1].requires_grad and not context.requires_grad  # the next stage gets a gradient-taking tensor
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
