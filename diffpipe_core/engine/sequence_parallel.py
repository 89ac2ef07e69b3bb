"""Ulysses sequence parallelism inside the pipeline (``sequence_parallel = N``).

The ``N`` ranks of one sequence group hold the same layers of the same pipeline stage and split a micro-batch's
token sequence. What each part does:

- Layout: ranks are ordered ``(stage, data replica, sequence rank)``, the sequence rank innermost. DeepSpeed sees a
  2-D topology whose ``data`` axis spans the ``data x sequence`` ranks of a stage, so pipeline p2p goes between the
  same ``(replica, sequence rank)`` of adjacent stages and the gradients are averaged over data *and* sequence ranks
  (the trained tensors are replicated over the sequence group). :func:`sequence_groups` makes the sequence groups.
- Tokens: the model's block layers (``ModelSpec.block_layers``) run on the local tokens. A forward pre-hook on the
  first block layer takes each rank's contiguous slice of the tensors the plugin declares in
  ``ModelSpec.sequence_tensors`` (the video tokens and what follows them, e.g. the rotary embedding); a forward hook
  on the last one gathers the token stream back (an autograd all-gather), so the head and the loss see the whole
  sequence, and every rank's loss is the mean over it. Hooks, not wrappers: the layers keep their class names (the
  memory savers find them) and parameter names. Under activation checkpointing the hooks sit inside the checkpointed
  call, so a block's recomputation in backward slices its input again and repeats its all-to-alls, in the same order
  on every rank of the group.
- Attention: every attention processor inside the block layers gets a :class:`UlyssesConfig` as its
  ``_parallel_config``, which diffusers' processors hand to ``dispatch_attention_fn`` for self- and joint attention
  (cross-attention to replicated text passes None: it runs on the local queries as it is). The registered attention
  backends are wrapped once (:func:`install_backend`): given a :class:`UlyssesConfig` they run through DeepSpeed's
  ``DistributedAttention`` (an all-to-all from sequence-split to head-split, the backend's own attention over the
  whole sequence with ``heads / N`` heads, and back). In joint attention the tokens beyond the local video tokens
  (a replicated text stream, after the video tokens as HunyuanVideo and Wan order them) are not exchanged: each rank
  takes its heads' share of them locally and the text output is all-gathered over heads.

Gradients: a replicated tensor's gradient on each rank is that rank's share; the all-gather's backward sums the
shares (an all-to-all on gloo), so the averaged parameter gradients equal the ``sequence_parallel = 1`` ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(eq=False)
class UlyssesConfig:
    """The ``_parallel_config`` diffpipe gives a block's attention processors: the sequence group and the number of
    video tokens each rank holds in the block running now (set by the block layer's pre-hook)."""

    group: Any
    size: int
    rank: int
    local_tokens: int = 0
    calls: int = field(default=0)  # attention calls that went through the all-to-all (tests read it)


def sequence_groups(stages: int, replicas: int, seq: int) -> Any:
    """Every rank creates every sequence group (``dist.new_group`` is collective); returns this rank's. Ranks are
    ``stage * replicas + replica_index``, the sequence groups consecutive runs of ``seq`` of them."""
    mine = None
    rank = dist.get_rank()
    for start in range(0, stages * replicas, seq):
        ranks = list(range(start, start + seq))
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = group
    return mine


def attention_modules(layers: list[nn.Module], indices: list[int]) -> list[tuple[str, nn.Module]]:
    """The self- and joint attention modules (diffusers' with a ``processor``, not ``is_cross_attention``: a
    cross-attention to replicated text runs on the local queries as it is) inside ``layers[i]`` for ``i`` in
    ``indices``, named ``"layer <i>: <module path>"``."""
    found = []
    for i in indices:
        for name, module in layers[i].named_modules():
            if hasattr(module, "processor") and hasattr(module, "heads") and not getattr(module, "is_cross_attention",
                                                                                         False):
                found.append((f"layer {i}: {name}", module))
    return found


def check_heads(size: int, attentions: list[tuple[str, nn.Module]], model: str) -> None:
    """Refuse ``sequence_parallel = size`` when it does not divide a block attention's head count, or when an
    attention processor cannot take a parallel config (it does not go through ``dispatch_attention_fn``)."""
    if not attentions:
        raise ValueError(f"sequence_parallel = {size}: model {model!r} has no diffusers attention in its block layers "
                         "(ModelSpec.block_layers); sequence parallelism needs one; use sequence_parallel = 1")
    for where, module in attentions:
        heads = int(module.heads)
        if heads % size:
            valid = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
            raise ValueError(f"sequence_parallel = {size}: model {model!r} has {heads} attention heads ({where}), "
                             f"which {size} does not divide; Ulysses splits the heads over the sequence ranks. "
                             f"Valid: {valid}")
        if not hasattr(type(module.processor), "_parallel_config"):
            raise ValueError(f"sequence_parallel = {size}: {where} uses {type(module.processor).__name__}, which "
                             "does not pass a parallel config to diffusers' dispatch_attention_fn; use "
                             "sequence_parallel = 1 for model " + repr(model))


def block_indices(layers: list[nn.Module], block_layers: tuple[str, ...]) -> list[int]:
    """Indices of the model's block layers (``ModelSpec.block_layers`` class names)."""
    return [i for i, layer in enumerate(layers) if type(layer).__name__ in block_layers]


def sequence_problems(size: int, layers: list[nn.Module], spec: Any) -> list[str]:
    """Why ``sequence_parallel = size`` cannot train the model whose pipeline layers are ``layers`` (any device,
    the meta one too), before any work: it declares no ``sequence_tensors`` or blocks, a block attention's heads are
    not divisible by ``size``, or its attention bypasses ``dispatch_attention_fn``."""
    if not spec.sequence_tensors or not spec.block_layers:
        return [f"sequence_parallel = {size}: model {spec.name!r} does not declare which tensors its blocks hold the "
                "token sequence in (ModelSpec.sequence_tensors); use sequence_parallel = 1"]
    try:
        check_heads(size, attention_modules(layers, block_indices(layers, spec.block_layers)), spec.name)
    except ValueError as exc:
        return [str(exc)]
    return []


def setup(layers: list[nn.Module], own: range, spec: Any, size: int, rank: int, group: Any) -> int:
    """Make this stage's block layers run on this rank's tokens (:func:`install_token_split`) with Ulysses
    attention (:func:`install_attention`); refuses what :func:`sequence_problems` finds. Returns how many attention
    modules of the stage take the all-to-all."""
    problems = sequence_problems(size, layers, spec)
    if problems:
        raise ValueError(problems[0])
    config = UlyssesConfig(group, size, rank)
    blocks = block_indices(layers, spec.block_layers)
    install_token_split(layers, blocks, own, spec.sequence_tensors, config)
    attentions = attention_modules(layers, [i for i in blocks if i in own])
    install_attention(attentions, config)
    return len(attentions)


def shard(x: torch.Tensor, dim: int, config: UlyssesConfig) -> torch.Tensor:
    """This rank's contiguous ``1/size`` of ``x`` along ``dim`` (refused unless it divides evenly)."""
    n = x.shape[dim]
    if n % config.size:
        raise ValueError(f"sequence_parallel = {config.size}: a micro-batch (or a [sample]'s latents) has {n} tokens "
                         f"along dimension {dim} of a sequence tensor {tuple(x.shape)}, which {config.size} does not "
                         "divide; choose frame buckets and resolutions (and [sample] resolution and frames) whose "
                         "latent token count is a multiple of it")
    step = n // config.size
    return x.narrow(dim, config.rank * step, step).contiguous()


class _Gather(torch.autograd.Function):
    """All-gather along a dimension; backward: each rank's slice of the sum of every rank's gradient, by one
    ``all_to_all_single`` (gloo has no reduce-scatter; torch's own autograd all-gather addresses a subgroup's ranks
    as global ones on gloo and fails outside the first group)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        stacked = torch.stack(grad.chunk(ctx.size, dim=ctx.dim)).contiguous()
        received = torch.empty_like(stacked)
        dist.all_to_all_single(received, stacked, group=ctx.group)
        return received.sum(dim=0), None, None, None


def gather(x: torch.Tensor, dim: int, config: UlyssesConfig) -> torch.Tensor:
    """The whole sequence from every rank's slice along ``dim`` (autograd: the backward sums the ranks' shares of
    the gradient and hands each rank its slice)."""
    return _Gather.apply(x, dim, config.group, config.size)


def install_token_split(
    layers: list[nn.Module], blocks: list[int], own: range, tensors: tuple[tuple[int, int], ...], config: UlyssesConfig
) -> None:
    """Hooks on this stage's block layers: each sets ``config.local_tokens``; the first block layer of the model
    slices ``tensors`` (``(index, dim)`` pairs, the token stream first) of its input, the last gathers the token
    stream of its output."""
    first, last = blocks[0], blocks[-1]
    token_index, token_dim = tensors[0]

    def split(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        inputs = list(args[0])
        for index, dim in tensors:
            inputs[index] = shard(inputs[index], dim, config)
        config.local_tokens = inputs[token_index].shape[token_dim]
        return (tuple(inputs), *args[1:])

    def note(_: nn.Module, args: tuple[Any, ...]) -> None:
        config.local_tokens = args[0][token_index].shape[token_dim]

    def collect(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        out = list(output)
        out[token_index] = gather(out[token_index], token_dim, config)
        return tuple(out)

    for i in blocks:
        if i not in own:
            continue
        layers[i].register_forward_pre_hook(split if i == first else note)
        if i == last:
            layers[i].register_forward_hook(collect)


def install_attention(attentions: list[tuple[str, nn.Module]], config: UlyssesConfig) -> None:
    """Give each attention module's processor ``config`` (a processor shared by several modules is copied once per
    module, so no other model is touched) and make the attention backends honour it."""
    import copy

    install_backend()
    for _, module in attentions:
        processor = copy.copy(module.processor)
        processor._parallel_config = config
        module.processor = processor


_installed = False


def install_backend() -> None:
    """Wrap every attention backend diffusers registered, once per process: a call whose ``_parallel_config`` is a
    :class:`UlyssesConfig` runs through :func:`ulysses_attention`; every other call goes to the backend as before."""
    global _installed
    if _installed:
        return
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    for name, fn in list(registry._backends.items()):
        accepted = set(registry._supported_arg_names[name])
        registry._backends[name] = _wrapped(fn, accepted)
        registry._supported_arg_names[name] = accepted | {"_parallel_config"}
    _installed = True


def _wrapped(fn: Any, accepted: set[str]) -> Any:
    def backend(**kwargs: Any) -> Any:
        config = kwargs.get("_parallel_config")
        if isinstance(config, UlyssesConfig):
            kwargs["_parallel_config"] = None
            if "_parallel_config" not in accepted:
                del kwargs["_parallel_config"]
            return ulysses_attention(fn, config, **kwargs)
        if "_parallel_config" not in accepted:
            kwargs.pop("_parallel_config", None)
        return fn(**kwargs)

    return backend


def ulysses_attention(
    fn: Any, config: UlyssesConfig, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """``fn`` (an attention backend, ``(B, S, H, D)`` tensors) over the whole sequence of a sequence group, through
    DeepSpeed's ``DistributedAttention``: the first ``config.local_tokens`` tokens of ``query``/``key``/``value`` are
    this rank's slice of the split sequence, any after them replicated (joint attention's text). Masks are over the
    whole sequence (the split tokens in rank order, then the replicated ones), as the model built them."""
    from deepspeed.sequence.layer import DistributedAttention

    n = config.local_tokens
    extra = query.shape[1] - n
    if n <= 0 or extra < 0 or key.shape[1] != query.shape[1]:
        raise RuntimeError(f"sequence parallel attention: query {tuple(query.shape)}, key {tuple(key.shape)} do not "
                           f"start with this rank's {n} tokens; the attention is not self- or joint attention")
    config.calls += 1
    heads = query.shape[2] // config.size
    mine = slice(config.rank * heads, (config.rank + 1) * heads)
    replicated = [x[:, n:, mine] for x in (query, key, value)] if extra else []
    held: list[torch.Tensor] = []

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if replicated:
            q, k, v = (torch.cat([a, b], dim=1) for a, b in zip((q, k, v), replicated, strict=True))
        out = fn(query=q, key=k, value=v, **kwargs)
        if isinstance(out, tuple):  # a backend returning (out, lse)
            out = out[0]
        if replicated:
            held.append(out[:, -extra:])
            out = out[:, :-extra]
        return out.contiguous()

    attention = DistributedAttention(local, config.group, scatter_idx=2, gather_idx=1)
    out = attention(query[:, :n], key[:, :n], value[:, :n], 0)
    if not held:
        return out
    return torch.cat([out, gather(held[0], 2, config)], dim=1)
