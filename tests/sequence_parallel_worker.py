"""One rank of the 2-rank Ulysses attention check in tests/test_sequence_parallel.py.

Usage: ``python sequence_parallel_worker.py OUT_DIR`` with the torch.distributed variables set. Every rank draws the
same full query/key/value (video tokens, then replicated text tokens, and a mask hiding one text token), runs
diffusers' ``dispatch_attention_fn`` on its slice with diffpipe's Ulysses config, and saves its output and
gradients to ``OUT_DIR/rank{RANK}.pt``; rank 0 also saves the reference (the whole sequence on one rank).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import dispatch_attention_fn

from diffpipe_core.engine.ds_patches import init_distributed
from diffpipe_core.engine.sequence_parallel import UlyssesConfig, install_backend, sequence_groups

B, S, T, H, D = 2, 8, 3, 4, 8


def main(out: Path) -> None:
    init_distributed("gloo")  # DeepSpeed's comm (its all-to-all) and torch's process group
    rank, world = dist.get_rank(), dist.get_world_size()
    group = sequence_groups(1, world, world)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S + T, H, D, generator=gen) for _ in range(3))
    weight = torch.randn(B, S + T, H, D, generator=gen)
    mask = torch.ones(B, 1, 1, S + T, dtype=torch.bool)
    mask[0, ..., -1] = False  # the first sample's last text token is padding
    install_backend()
    result = {}
    if rank == 0:  # the reference: the whole sequence on one rank
        full = [x.clone().requires_grad_(True) for x in (q, k, v)]
        ref = dispatch_attention_fn(*full, attn_mask=mask)
        (ref * weight).sum().backward()
        result["ref"] = ref.detach()
        result["ref_grads"] = [x.grad for x in full]
    n = S // world
    mine = slice(rank * n, (rank + 1) * n)
    video = [x[:, mine].clone().requires_grad_(True) for x in (q, k, v)]
    text = [x[:, S:].clone().requires_grad_(True) for x in (q, k, v)]
    config = UlyssesConfig(group, world, rank, local_tokens=n)
    joint = [torch.cat([a, b], dim=1) for a, b in zip(video, text, strict=True)]
    out_local = dispatch_attention_fn(*joint, attn_mask=mask, parallel_config=config)
    # this rank's share of the loss: its video tokens, and 1/world of the replicated text tokens'
    loss = (out_local[:, :n] * weight[:, mine]).sum() + (out_local[:, n:] * weight[:, S:]).sum() / world
    loss.backward()
    result.update(out=out_local.detach(), video_grads=[x.grad for x in video], text_grads=[x.grad for x in text],
                  calls=config.calls)
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
