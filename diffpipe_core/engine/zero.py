"""``[run] zero_stage = 1``: DeepSpeed's ZeRO stage 1 under the pipeline engine, the optimizer state sharded over
each stage's data-parallel replicas.

DeepSpeed's ZeRO optimizer (``DeepSpeedZeroOptimizer``) flattens a parameter group's weights into one buffer (the
model's parameters become views of it), splits the buffer into one equal partition per replica, and gives the
client optimizer (diffpipe's, built from ``[optimizer]``) a float32 copy of this replica's partition as its only
parameter. So each replica holds the optimizer state of 1/N of the weights; after the step the partitions are
all-gathered back into the weights.

Checkpoints stay layout-free: :func:`full_state_dict` gathers the replicas' partitions of every state tensor and
cuts them back into per-parameter state, numbered as an unsharded optimizer numbers it, so the checkpoint reads as
one written without ZeRO; :func:`load_full_state_dict` cuts this replica's partition out of such a state. A run
therefore resumes with another number of replicas (re-sharded), or with ZeRO turned on or off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def ds_config(stage: int) -> dict[str, Any]:
    """The DeepSpeed config keys of ``zero_stage`` (none for 0). diffpipe's optimizers are not on DeepSpeed's
    list of tested ZeRO optimizers (torch's SGD, say), hence ``zero_allow_untested_optimizer``; config validation
    admits only elementwise ones (:data:`~diffpipe_core.optimizer_names.ZERO_OPTIMIZERS`)."""
    if not stage:
        return {}
    return {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}


def _groups(zero: Any) -> list[tuple[list[torch.Tensor], list[int], torch.Tensor, int, int, Any]]:
    """Per parameter group: its model parameters in flat order, their offsets in the flat buffer, this replica's
    float32 partition, the partition size, this replica's partition number and the replicas' process group."""
    if getattr(zero, "round_robin_gradients", False):
        raise ValueError("zero_stage: DeepSpeed's round_robin_gradients reorders the partitions; leave it off")
    out = []
    for i, params in enumerate(zero.round_robin_bit16_groups):
        group = zero.real_dp_process_group[i]
        out.append((params, list(zero.round_robin_bit16_offsets[i]), zero.single_partition_of_fp32_groups[i],
                    int(zero.partition_size[i]), dist.get_rank(group=group), group))
    return out


def _sharded(value: Any, part: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == part.shape


def model_params(zero: Any) -> list[torch.Tensor]:
    """The model parameters the ZeRO optimizer steps, in the order :func:`full_state_dict` numbers them."""
    return [p for params, *_ in _groups(zero) for p in params]


def full_state_dict(zero: Any) -> dict[str, Any]:
    """Collective over each group's replicas: the client optimizer's state as an unsharded optimizer over the model
    parameters would hold it (``{"state": {number: {...}}, "param_groups": [...]}``, numbered by
    :func:`model_params`)."""
    inner = zero.optimizer
    saved_groups = inner.state_dict()["param_groups"]
    state: dict[int, dict[str, Any]] = {}
    groups, number = [], 0
    for (params, offsets, part, _, _, group), saved_group in zip(_groups(zero), saved_groups, strict=True):
        own = inner.state.get(part, {})
        full = {}
        for key, value in own.items():
            if _sharded(value, part):
                chunks = [torch.empty_like(value) for _ in range(dist.get_world_size(group=group))]
                dist.all_gather(chunks, value.contiguous(), group=group)
                full[key] = torch.cat(chunks)
        numbers = []
        for param, offset in zip(params, offsets, strict=True):
            if own:
                state[number] = {k: full[k][offset : offset + param.numel()].view(param.shape).clone() if k in full
                                 else v for k, v in own.items()}
            numbers.append(number)
            number += 1
        groups.append({**saved_group, "params": numbers})
    return {"state": state, "param_groups": groups}


def load_full_state_dict(zero: Any, saved: dict[str, Any]) -> None:
    """Load a :func:`full_state_dict` (or an unsharded optimizer's state dict over the same parameters, in the same
    order) into this replica: each state tensor's share of the flat buffer."""
    inner = zero.optimizer
    layout = _groups(zero)
    if len(saved["param_groups"]) != len(layout):
        raise ValueError(f"zero_stage: the saved optimizer state has {len(saved['param_groups'])} parameter groups, "
                         f"this run's optimizer {len(layout)}")
    state: dict[int, dict[str, Any]] = {}
    for i, ((params, offsets, part, size, rank, _), group) in enumerate(zip(layout, saved["param_groups"],
                                                                           strict=True)):
        entries = [saved["state"].get(n) for n in group["params"]]
        first = next((e for e in entries if e), None)
        if first is None:
            continue
        merged: dict[str, Any] = {}
        for key, sample in first.items():
            if not (torch.is_tensor(sample) and sample.dim() > 0):
                merged[key] = sample
                continue
            flat = torch.zeros(size * (rank + 1), dtype=part.dtype)  # only up to this replica's partition
            for param, offset, entry in zip(params, offsets, entries, strict=True):
                start = offset
                stop = min(offset + param.numel(), flat.numel())
                if entry and start < flat.numel():
                    flat[start:stop] = entry[key].reshape(-1)[: stop - start].to(part.dtype)
            merged[key] = flat[rank * size :].to(part.device).clone()
        state[i] = merged
    groups = [{**g, "params": [i]} for i, g in enumerate(saved["param_groups"])]
    inner.load_state_dict({"state": state, "param_groups": groups})

