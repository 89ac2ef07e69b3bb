"""Every DeepSpeed behaviour we change, in one place, each with a test in tests/test_ds_patches.py.

1. ``ExplicitPartitionPipelineModule``: DeepSpeed's ``partition_method="parameters"`` counts only
   trainable parameters (so a LoRA run puts the whole frozen base model on one stage) and builds
   every layer to count them. We pass stage boundaries we computed ourselves (frozen parameters
   included, or the user's ``partition_split``).
2. ``OutputsRequireGrad``: DeepSpeed sends every float tensor a stage outputs to the next stage and
   later runs backward from it with the gradient it gets back. When a stage's layers are frozen (the
   embedders of a LoRA run) its outputs carry no autograd graph and that backward fails. Wrapping the
   last layer of each stage but the final one marks such outputs as leaves that require grad, so the
   backward is a no-op there. (Making the first layer's inputs require grad would also work, but it
   computes input gradients nobody needs.) It also makes them contiguous: gloo sends only contiguous
   tensors, and a transposed patch embedding is not.
3. ``name_gradless_boundary_tensors``: a float tensor that crosses a stage boundary but that the next
   stages never use gets no gradient, and DeepSpeed then stops the first step with a bare
   ``assert buffer.grad is not None`` in ``_exec_send_grads``. We check first and raise
   :class:`StageBoundaryError` naming the layer that produced the tensor and its index.
4. ``forward_outputs``: ``PipelineEngine.eval_batch(compute_loss=False)`` adds each micro-batch's outputs
   to ``total_loss``, which still holds the last ``train_batch``'s scalar loss, and fails indexing it; and adds
   the outputs of micro-batches of different buckets (shapes) to each other, which fails too. We clear it before
   each micro-batch and put it back after the call (used by diffpipe_core.sampling.pipeline and CFG training).
5. ``init_distributed``: on a CPU machine ``deepspeed.init_distributed`` JIT-compiles DeepSpeed's
   ``deepspeed_shm_comm`` op with g++ (``TorchBackend.__init__`` calls ``deepspeed.comm.torch.build_shm_op``;
   about 80 s, under a lock in the per-user ``~/.cache/torch_extensions`` that every environment shares and a
   killed build leaves behind). The op serves only ``inference_all_reduce`` (tensor-parallel inference), which
   diffpipe never calls; without it DeepSpeed falls back to the process group. We build the backend with
   ``build_shm_op`` answering None.
6. ``guard_op_builds``: any DeepSpeed op that is still JIT-built (a plugin's DeepSpeed optimizer, say) waits on
   torch's ``<extensions dir>/<op>/lock`` forever and silently when a killed build left it. We wait for it
   ourselves first: after a few seconds we say which lock we wait for and whether a process holds it (so when it
   is safe to delete), and give up with :class:`OpBuildLockTimeout` after a timeout. The extensions folder is
   one per Python environment unless ``TORCH_EXTENSIONS_DIR`` is set, so two environments never share a build.
7. ``keep_compiled_backward_buffers``: a stage that is not the last runs backward one output tensor at a time,
   with ``retain_graph=True`` for all but the last (``PipelineEngine._exec_backward_pass``). The backward of a
   ``torch.compile``'d layer donates its saved buffers and refuses a retained graph ("compiled with non-empty
   donated buffers"), so ``compile`` broke every run of more than one stage. With ``compile`` on we turn buffer
   donation off: the compiled backward keeps its saved tensors, as eager autograd does.
8. ``skip_single_replica_allreduce``: at the end of every step ``PipelineEngine._exec_reduce_grads`` all-reduces
   the gradients over the data-parallel group even when that group is one process (every run of 1 process, or
   of as many processes as stages): it flattens every gradient into buckets, all-reduces them with itself,
   divides by 1 and copies them back (8.5 ms a step on a small HunyuanVideo-1.5 on CPU, as much as a block's
   forward). With one replica and no ZeRO the result is the gradients themselves, so we turn the reduction off
   there (``pipeline_enable_backward_allreduce``); with two or more replicas it runs as before.
9. ``lean_step``: two walks over the whole module tree every step, which cost as much as a block's forward on a
   small model (about 5 ms each on a small HunyuanVideo-1.5 on CPU, and they grow with the number of modules):
   ``train_batch`` calls ``module.train()``, which sets the flag on every submodule again, and after the
   optimizer step ``DeepSpeedEngine.zero_grad`` walks ``module.named_parameters()``, frozen ones included, to set
   each ``.grad`` to None. We clear the gradients of the optimizer's parameters (the only ones that get any), and
   let ``module.train(mode)`` walk only when the mode asked for is not the one it last set. Mode changes must go
   through the pipeline module (the engine's ``eval_batch`` does, as do diffpipe's evaluation and sampling);
   a submodule switched directly stays as it is until the module's mode next changes.
10. ``keep_idle_groups_gradless``: with two or more data-parallel replicas, DeepSpeed's gradient all-reduce
   (``buffered_allreduce_fallback``) gives every parameter without a gradient a zero one, so that all ranks reduce
   the same sizes. A parameter group no replica used in a step (one of Wan 2.2 A14B's two experts when no sample of
   the step fell on it) then takes an optimizer step on a zero gradient: AdamW's moments move it and weight decay
   shrinks it, which a run on one replica (no gradient: no step) never does. Before the reduction the replicas agree
   which groups any of them used; after it, the groups none used get their gradients back as None.
11. ``release_forward_inputs``: ``PipelineEngine._exec_forward_pass`` runs a stage on a clone of the micro-batch's
   input buffer and keeps the buffer until the micro-batch's backward, which reads only its ``.grad``. A stage
   whose first layer keeps its input for backward (a LoRA'd linear, a norm) then holds the input twice for every
   micro-batch in flight: with S stages and gradient accumulation >= S the first stage holds S extra copies
   (issue 46). After the forward we point each float buffer's data at a single broadcast zero of its shape:
   the gradient still accumulates into it (autograd checks the shape only) and DeepSpeed sends it as before,
   and the clone the layers kept is the one copy left.
12. ``release_freed_before_instructions``: on a CPU run a stage's activations live in the worker's C heap, and
   glibc keeps what a pipeline instruction frees (a forward's temporaries, a received buffer, a backward's scratch)
   resident in the heap's middle, where the next instruction's differently sized tensors cannot always reuse it.
   With several micro-batches in flight this slack sat beside the stage's peak: 14-22 MiB of each of 4 stages'
   model memory on a 0.28 B Flux, 4-12% (issue 46's bench). Before every instruction of the schedule we return the
   heap's free pages (``host_memory.release_freed``); the step's arithmetic is unchanged, and the run took as long
   (349 s against 352 s). GPU runs keep their activations on the device and are not patched.

Activation checkpointing no longer goes through DeepSpeed (whose default checkpoint function broke on a
first layer with several float outputs): diffpipe_core.memory wraps the block layers itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch import nn

from diffpipe_core.engine.host_memory import release_freed


class ExplicitPartitionPipelineModule(PipelineModule):
    """A PipelineModule whose stage boundaries are given (``parts``: N+1 layer indices)."""

    def __init__(self, layers: list[Any], parts: list[int], **kwargs: Any) -> None:
        self._explicit_parts = list(parts)
        super().__init__(layers=layers, partition_method="explicit", **kwargs)

    def _partition_layers(self, method: str = "explicit") -> None:
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if len(self._explicit_parts) != self.num_stages + 1:
            raise ValueError(f"need {self.num_stages + 1} boundaries, got {self._explicit_parts}")
        self.parts = self._explicit_parts
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


class OutputsRequireGrad(nn.Module):
    """Wraps the last layer of a non-final stage so every float output can receive a gradient."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs: Any) -> Any:
        outputs = self.layer(inputs)
        if torch.is_tensor(outputs):  # keep a lone tensor a tensor: the next stage's layer expects what it got before
            return _require_grad(outputs)
        return tuple(_require_grad(x) for x in outputs)


def _require_grad(x: Any) -> Any:
    if not torch.is_tensor(x):
        return x
    x = x.contiguous()  # gloo sends only contiguous tensors
    if x.is_floating_point() and not x.requires_grad:
        # a new tensor object: a tensor the last block hands on unchanged is also its input, which activation
        # checkpointing keeps for the recomputation; made to require a gradient in place, the recomputation would
        # save what the forward did not (torch's CheckpointError)
        return x.detach().requires_grad_(True)
    return x


def wrap_stage_boundaries(layers: list[nn.Module], parts: list[int]) -> list[nn.Module]:
    """Apply ``OutputsRequireGrad`` to the last layer of every stage except the final one."""
    out = list(layers)
    for stop in parts[1:-1]:
        out[stop - 1] = OutputsRequireGrad(out[stop - 1])
    return out


class StageBoundaryError(RuntimeError):
    """A float tensor crossing a pipeline stage boundary is not used by the stages after it."""


def name_gradless_boundary_tensors(engine: PipelineEngine, producer: str) -> None:
    """Check, before DeepSpeed sends gradients back to the previous stage, that every float tensor this stage
    received got one; otherwise raise :class:`StageBoundaryError` naming ``producer`` (the previous stage's
    last layer, e.g. ``"layer 3 (EmbedLayer)"``) and the tensor's index. Applies to this engine only."""

    def send_grads(self: PipelineEngine, buffer_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        received = inputs if isinstance(inputs, tuple) else (inputs,)
        for index, tensor in enumerate(received):
            if torch.is_tensor(tensor) and tensor.is_floating_point() and tensor.grad is None:
                raise StageBoundaryError(
                    f"pipeline stage {self.stage_id}: output {index} of {producer} (shape {tuple(tensor.shape)}, "
                    f"{tensor.dtype}) got no gradient: no later layer uses it. Every float tensor a layer returns "
                    "must be used downstream (pass integer tensors for sizes, or stop returning it)"
                )
        PipelineEngine._exec_send_grads(self, buffer_id)

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.SendGrad: send_grads}


def release_forward_inputs(engine: PipelineEngine) -> None:
    """Patch 11 on this engine: after each forward pass, the input buffer's float tensors keep their shape and
    gradient but no data (the forward ran on their clones)."""

    def forward_pass(self: PipelineEngine, buffer_id: int) -> None:
        PipelineEngine._exec_forward_pass(self, buffer_id)
        inputs = self.pipe_buffers["inputs"][buffer_id]
        for tensor in inputs if isinstance(inputs, tuple) else (inputs,):
            if torch.is_tensor(tensor) and tensor.is_floating_point() and tensor.dim() > 0:
                tensor.data = torch.zeros((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.ForwardPass: forward_pass}


def forward_outputs(engine: PipelineEngine, data_iter: Any, num_micro_batches: int) -> list[Any] | None:
    """A forward-only pass of ``num_micro_batches`` through the pipeline (no loss): on the last stage each
    micro-batch's outputs (a list of tensors), elsewhere None."""
    saved, own_map = engine.total_loss, engine.__dict__.get("_INSTRUCTION_MAP")
    run_forward = engine._INSTRUCTION_MAP[schedule.ForwardPass]

    def forward_pass(self: PipelineEngine, buffer_id: int) -> None:
        self.total_loss = None  # the previous micro-batch's outputs: another bucket's may have another shape
        run_forward(self, buffer_id)

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.ForwardPass: forward_pass}
    engine.total_loss = None
    try:
        return engine.eval_batch(
            data_iter, compute_loss=False, reduce_output=None, bcast_loss=False, num_micro_batches=num_micro_batches
        )
    finally:
        engine.total_loss = saved
        if own_map is None:
            del engine._INSTRUCTION_MAP
        else:
            engine._INSTRUCTION_MAP = own_map


@contextlib.contextmanager
def _no_shm_op() -> Iterator[None]:
    import importlib

    # not ``import deepspeed.comm.torch as``: the package's ``torch`` attribute is torch itself
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    original = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = original


def init_distributed(backend: str) -> None:
    """``deepspeed.init_distributed(dist_backend=backend)`` without building the CPU shared-memory comm op."""
    import deepspeed

    with _no_shm_op():
        deepspeed.init_distributed(dist_backend=backend, verbose=False)


EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
BUILD_LOCK_TIMEOUT_ENV = "DIFFPIPE_OP_BUILD_TIMEOUT"


class OpBuildLockTimeout(TimeoutError):
    """A DeepSpeed op build waited on another build's lock file for longer than the timeout."""


def environment_extensions_dir() -> Path:
    """The torch extensions folder of this Python environment: ``$XDG_CACHE_HOME`` (or ``~/.cache``)
    ``/diffpipe/torch_extensions/<env>``, ``<env>`` a hash of the environment's prefix and torch's version."""
    key = hashlib.sha256(f"{sys.prefix}\0{torch.__version__}".encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "diffpipe" / "torch_extensions" / f"{Path(sys.prefix).name}-{key}"


def use_environment_extensions_dir() -> None:
    """Make op builds of this process and its children use :func:`environment_extensions_dir` unless the user
    chose a folder with ``TORCH_EXTENSIONS_DIR``."""
    os.environ.setdefault(EXTENSIONS_ENV, str(environment_extensions_dir()))


def lock_holders(lock: Path) -> tuple[list[str], bool]:
    """Processes that have ``lock`` open (torch's build lock stays open while its build runs), as
    ``"pid N (command)"``, and whether every process could be checked (another user's cannot)."""
    holders: list[str] = []
    complete = True
    target = str(lock.resolve())
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fds = list((proc / "fd").iterdir())
        except PermissionError:
            complete = False
            continue
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    holders.append(f"pid {proc.name} ({cmd[:120]})")
                    break
            except OSError:
                continue
    return holders, complete


def _lock_notice(name: str, lock: Path) -> str:
    holders, complete = lock_holders(lock)
    if holders:
        who = f"held by {', '.join(holders)}; it is removed when that build ends"
    elif complete:
        who = "no process holds it, so it is stale (a build was killed): it is safe to delete"
    else:
        who = "no process of yours holds it; safe to delete once no other user's build of it runs"
    return f"DeepSpeed's {name} op build waits for the lock {lock}: {who}"


def wait_for_build_lock(
    name: str,
    lock: Path,
    timeout: float,
    notice_after: float = 5.0,
    say: Callable[[str], None] = lambda line: print(f"diffpipe: {line}", file=sys.stderr, flush=True),
) -> None:
    """Return once ``lock`` is gone; say what it waits for after ``notice_after`` s, raise
    :class:`OpBuildLockTimeout` after ``timeout`` s."""
    start = time.monotonic()
    noticed = False
    while lock.exists():
        waited = time.monotonic() - start
        if waited >= timeout:
            raise OpBuildLockTimeout(
                f"{_lock_notice(name, lock)}; gave up after {timeout:g}s (set {BUILD_LOCK_TIMEOUT_ENV} to wait longer)"
            )
        if waited >= notice_after and not noticed:
            say(f"{_lock_notice(name, lock)} (giving up after {timeout:g}s)")
            noticed = True
        time.sleep(0.2)


_guarded = False


def guard_op_builds(timeout: float | None = None, notice_after: float = 5.0) -> None:
    """Make every DeepSpeed JIT op build of this process wait for a held build lock through
    :func:`wait_for_build_lock` (timeout: ``timeout``, else ``DIFFPIPE_OP_BUILD_TIMEOUT``, else 600 s)."""
    global _guarded
    if _guarded:
        return
    from deepspeed.ops.op_builder.builder import OpBuilder

    original = OpBuilder.jit_load

    def jit_load(self: OpBuilder, verbose: bool = True) -> Any:
        from torch.utils.cpp_extension import _get_build_directory  # imports setuptools: ~1 s, only for a build

        limit = timeout if timeout is not None else float(os.environ.get(BUILD_LOCK_TIMEOUT_ENV) or 600)
        lock = Path(_get_build_directory(self.name, verbose=False)) / "lock"
        wait_for_build_lock(self.name, lock, limit, notice_after)
        return original(self, verbose)

    OpBuilder.jit_load = jit_load
    _guarded = True
def single_backward(engine: PipelineEngine) -> None:
    """With ``[optimizer] gradient_release``: a stage that is not the last runs one backward over all its float
    outputs instead of DeepSpeed's one per output (patch 7's ``retain_graph`` loop), so each parameter's gradient
    is completed, and its post-accumulate-grad hook fires, once per micro-batch. Applies to this engine only."""

    def backward(self: PipelineEngine, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.is_last_stage() or not isinstance(outputs, tuple) or self.is_pipe_partitioned:
            return PipelineEngine._exec_backward_pass(self, buffer_id)
        out_tensors = [t for t in outputs if t.is_floating_point()]
        grads = list(self.grad_layer)
        assert len(out_tensors) == len(grads), (len(out_tensors), len(grads))
        self._running_engine_backward = True
        try:
            torch.autograd.backward(out_tensors, grad_tensors=grads)
        finally:
            self._running_engine_backward = False
        self.pipe_buffers["output_tensors"][buffer_id] = None
        self.pipe_buffers["outputs"][buffer_id] = None
        return None

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.BackwardPass: backward}


def keep_compiled_backward_buffers() -> None:
    """Let compiled layers' backward run under DeepSpeed's per-output ``retain_graph=True`` backward (patch 7).
    Process-wide torch setting; called before the blocks are compiled."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


def skip_single_replica_allreduce(engine: PipelineEngine) -> bool:
    """Turn off the end-of-step gradient all-reduce where the data-parallel group is one process and ZeRO is off
    (patch 8): there it reproduces the gradients exactly. Returns whether it was turned off."""
    if engine.dp_world_size != 1 or engine.zero_optimization_stage() != 0:
        return False
    engine.pipeline_enable_backward_allreduce = False
    return True


def lean_step(engine: PipelineEngine) -> None:
    """Patch 9 on this engine: ``zero_grad`` clears only the optimizer's parameters' gradients, and the pipeline
    module's ``train(mode)`` walks its submodules only when ``mode`` is not the mode it last set."""
    optimizer, module = engine.optimizer, engine.module
    engine.zero_grad = lambda: optimizer.zero_grad(set_to_none=True)
    walk = module.train
    last: list[bool] = []

    def train(mode: bool = True) -> Any:
        if last != [mode]:
            walk(mode)
            last[:] = [mode]
        return module

    module.train = train


def keep_idle_groups_gradless(engine: PipelineEngine, groups: list[list[torch.Tensor]]) -> bool:
    """Patch 10 on this engine: after the data-parallel gradient all-reduce, the parameter groups (``groups``: the
    optimizer's, their tensors) that no replica gave a gradient have none again. Returns whether it was applied
    (two or more replicas and two or more groups)."""
    if engine.dp_world_size == 1 or len(groups) < 2 or not engine.pipeline_enable_backward_allreduce:
        return False
    import torch.distributed as dist

    dp_group = engine.mpu.get_data_parallel_group()
    device = next(p.device for group in groups for p in group)
    reduce = engine.allreduce_gradients

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        used = torch.tensor([float(any(p.grad is not None for p in g)) for g in groups], device=device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=dp_group)
        result = reduce(*args, **kwargs)
        for flag, group in zip(used.tolist(), groups, strict=True):
            if not flag:
                for p in group:
                    p.grad = None
        return result

    engine.allreduce_gradients = allreduce_gradients
    return True


def release_freed_before_instructions(engine: PipelineEngine) -> None:
    """Patch 12 on this engine (CPU runs): the C heap's free pages go back to the system before every instruction
    of the pipeline schedule, so a stage's resident memory stays what its tensors hold. Apply it after the other
    patches: it wraps what they installed."""

    def releasing(instruction: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: PipelineEngine, *args: Any, **kwargs: Any) -> Any:
            release_freed()
            return instruction(self, *args, **kwargs)

        return run

    engine._INSTRUCTION_MAP = {kind: releasing(fn) for kind, fn in engine._INSTRUCTION_MAP.items()}
