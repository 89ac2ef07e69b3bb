"""Never save non-finite weights: every save and checkpoint first checks, on every rank, that the tensors it
would write are finite; otherwise the run stops naming them and the last finite save stays as it was."""

from __future__ import annotations

import torch
import torch.distributed as dist


class NonFiniteWeights(FloatingPointError):
    """Trainable tensors hold NaN or infinity; nothing was written."""


def nonfinite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors with a NaN or infinite value (one host sync for all of them)."""
    names = [n for n, t in tensors.items() if t.is_floating_point() and t.device.type != "meta"]
    if not names:
        return []
    flags = torch.stack([~torch.isfinite(tensors[n]).all() for n in names]).cpu().tolist()
    return [n for n, bad in zip(names, flags, strict=True) if bad]


def check_finite(tensors: dict[str, torch.Tensor], what: str, kept: str, device: torch.device) -> None:
    """Collective when a process group is up: raise :class:`NonFiniteWeights` on every rank when any rank's
    ``tensors`` are not all finite, naming them (``what``: the save refused; ``kept``: what stays)."""
    bad = nonfinite_names(tensors)
    if dist.is_initialized() and dist.get_world_size() > 1:
        count = torch.tensor([float(len(bad))], device=device)
        dist.all_reduce(count)
        if count.item() == 0:
            return
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, bad)
        bad = sorted({n for part in everyone for n in part})
    if not bad:
        return
    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    raise NonFiniteWeights(
        f"{len(bad)} trained tensor{'s' if len(bad) != 1 else ''} hold NaN or infinite values ({shown}); {what} "
        f"not written, {kept}. Lower the learning rate, keep gradient_clipping on, or train in float32"
    )
