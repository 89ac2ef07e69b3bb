"""Wan 2.2 A14B's two experts in one run (``[model] expert = "both"``): the pipeline layers of both transformers side
by side, each sample of a micro-batch through the expert its time belongs to.

The diffusion model is the high-noise ``transformer`` holding the low-noise ``transformer_2`` as a submodule (the
core's held components: its parameters are named ``transformer_2.<name>`` and load per stage from its own folder or
file). Layer k of the run is layer k of both experts (:class:`ExpertPair`): on every pipeline stage both experts'
blocks of that stage, so each stage's memory holds both, as the GPU-fit plan counts them.

The first layer gets the single-expert inputs plus, last, ``expert`` ``(B,)`` (0: ``transformer``, 1:
``transformer_2``); every layer passes it on after its own outputs, the head drops it. A layer runs each expert's
half of the micro-batch (its samples' rows of every per-sample tensor) through that expert's layer and puts the rows
back in order, so each sample's prediction and loss are exactly the single-expert model's for that sample, and each
expert's parameters get gradients only from its own samples. A micro-batch of one expert runs that expert alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from diffpipe_wan.layers import BlockLayer, EmbedLayer, HeadLayer, Tensors
from diffpipe_wan.plugin import LOW_PREFIX

HIGH, LOW = 0, 1  # the expert index: transformer (t >= boundary_ratio), transformer_2 (t < boundary_ratio)
#: which tensors of a layer's inputs / outputs hold one row per sample (the rest, the rotary tables and the token
#: grid, are the same for every sample and for both experts)
BETWEEN_BLOCKS = (0, 1, 2, 3)  # hidden, context, modulation, temb (then rope cos, sin, grid)
AFTER_LAST_BLOCK = (0, 1)  # hidden, temb (then grid)


def expert_index(t: torch.Tensor, boundary: float) -> torch.Tensor:
    """The expert of each time ``t`` in (0, 1): :data:`HIGH` where ``t >= boundary`` (``WanPipeline`` runs
    ``transformer`` while ``timestep >= boundary_ratio * num_train_timesteps``), else :data:`LOW`."""
    return torch.where(t >= boundary, HIGH, LOW).long()


class ExpertPair(nn.Module):
    """The same pipeline layer of both experts (``high``, ``low``); ``batched_in`` / ``batched_out``: the positions
    of the per-sample tensors among the layer's inputs / outputs (None: all of them)."""

    def __init__(self, high: nn.Module, low: nn.Module, batched_in=None, batched_out=None, keep_expert=True) -> None:
        super().__init__()
        self.high, self.low = high, low
        self.batched_in, self.batched_out, self.keep_expert = batched_in, batched_out, keep_expert

    def forward(self, inputs: Tensors) -> Tensors:
        *inputs, expert = inputs
        rows = [(layer, (expert == side).nonzero().squeeze(1)) for side, layer in ((HIGH, self.high), (LOW, self.low))]
        rows = [(layer, idx) for layer, idx in rows if idx.numel()]
        if len(rows) == 1:  # the whole micro-batch on one expert: its layer as it is
            out = rows[0][0](tuple(inputs))
        else:
            parts = [layer(self._rows(inputs, idx, self.batched_in)) for layer, idx in rows]
            back = torch.argsort(torch.cat([idx for _, idx in rows]))  # cat(rows)[back] is the batch in order
            out = tuple(
                torch.cat(same)[back] if self._batched(i, self.batched_out) else same[0]
                for i, same in enumerate(zip(*parts, strict=True))
            )
        return (*out, expert) if self.keep_expert else out

    @staticmethod
    def _batched(i: int, which) -> bool:
        return which is None or i in which

    def _rows(self, inputs: list[torch.Tensor], idx: torch.Tensor, which) -> Tensors:
        return tuple(x.index_select(0, idx) if self._batched(i, which) else x for i, x in enumerate(inputs))


class ExpertEmbed(ExpertPair):
    """Both experts' :class:`~diffpipe_wan.layers.EmbedLayer`."""

    def __init__(self, high: nn.Module, low: nn.Module) -> None:
        super().__init__(EmbedLayer(high), EmbedLayer(low), None, BETWEEN_BLOCKS)


class ExpertBlocks(ExpertPair):
    """Block k of both experts (:class:`~diffpipe_wan.layers.BlockLayer`)."""

    def __init__(self, high: nn.Module, low: nn.Module, last: bool) -> None:
        out = AFTER_LAST_BLOCK if last else BETWEEN_BLOCKS
        super().__init__(BlockLayer(high, last=last), BlockLayer(low, last=last), BETWEEN_BLOCKS, out)


class ExpertHead(ExpertPair):
    """Both experts' :class:`~diffpipe_wan.layers.HeadLayer`; returns the prediction alone."""

    def __init__(self, high: nn.Module, low: nn.Module) -> None:
        super().__init__(HeadLayer(high), HeadLayer(low), AFTER_LAST_BLOCK, None, keep_expert=False)


def split_both(model: nn.Module) -> list[nn.Module]:
    """The pipeline layers of the high-noise ``model`` and the ``model.transformer_2`` it holds, pairwise."""
    low = model.transformer_2
    high_blocks, low_blocks = list(model.blocks), list(low.blocks)
    if len(high_blocks) != len(low_blocks) or not high_blocks:
        raise ValueError(
            f"the two Wan experts must have the same number of blocks: transformer {len(high_blocks)}, transformer_2 "
            f"{len(low_blocks)}"
        )
    last = len(high_blocks) - 1
    blocks = [ExpertBlocks(h, lo, i == last) for i, (h, lo) in enumerate(zip(high_blocks, low_blocks, strict=True))]
    return [ExpertEmbed(model, low), *blocks, ExpertHead(model, low)]


def export_both(
    saved_dir: Path, configs: dict[str, dict], labels: dict[str, dict[str, str]], out_dir: Path, format: str,
    single_file_name: str,
) -> None:
    """A saved full fine-tune of both experts (one model: ``transformer_2.`` names the low-noise expert's tensors)
    as one export per expert in ``out_dir/high_noise`` and ``out_dir/low_noise``: a diffusers model folder
    (``config.json`` and ``diffusion_pytorch_model.safetensors``) or, ``single_file``, one original-layout file; every
    file's metadata holds the expert's ``labels``."""
    from diffpipe_core.atomic import atomic_save_safetensors, atomic_write_text
    from diffpipe_core.engine.saving import read_saved_model
    from diffpipe_wan.original import layout_for_config

    state = read_saved_model(saved_dir)
    low = {k[len(LOW_PREFIX) :]: v.contiguous() for k, v in state.items() if k.startswith(LOW_PREFIX)}
    high = {k: v.contiguous() for k, v in state.items() if not k.startswith(LOW_PREFIX)}
    for expert, part in (("high", high), ("low", low)):
        folder = out_dir / labels[expert]["diffpipe.expert"]
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"format": "pt", **labels[expert]}
        if format == "diffusers":
            atomic_write_text(folder / "config.json", json.dumps(configs[expert], indent=2) + "\n")
            atomic_save_safetensors(part, folder / "diffusion_pytorch_model.safetensors", meta)
        else:
            original = layout_for_config(configs[expert]).to_original(part)
            atomic_save_safetensors(original, folder / single_file_name, meta)
