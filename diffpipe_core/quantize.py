"""Quantized base weights (``[model] quantize``), applied to one pipeline stage right after its layers are loaded.

Each ``nn.Linear`` of the stage's block layers (``ModelSpec.block_layers``: the repeated transformer blocks,
nearly all of a model's weights) is replaced by a quantized module holding the same (frozen) weights:

- ``"nf4"``: bitsandbytes ``Linear4bit`` (NF4, blockwise scales), computing in the model's dtype;
- ``"int8"``: bitsandbytes ``Linear8bitLt`` (row-wise int8, LLM.int8() matmul);
- ``"float8"``: :class:`Float8Linear`, float8_e4m3fn storage with one float32 scale per tensor, computing in the
  model's dtype (bf16 for a bf16 model);
- ``"float8_e5m2"``: the same with float8_e5m2 storage (2 mantissa bits, 5 exponent bits: coarser steps, wider
  range), for models whose weights float8_e4m3 does not hold well (diffusion-pipe's advice for Cosmos-Predict2).

Left in the run's dtype: the layers outside the blocks (input embedders, final projection: a small share of the
weights, the most sensitive to precision, and plugins read their weights' dtype), linears the model keeps in
float32 (diffusers' ``_keep_in_fp32_modules``), linears with fewer than :data:`MIN_ELEMENTS` weights (nothing
to gain in memory, precision to lose), and every parameter that is not a linear's weight (norms, biases).
LoRA (peft) is applied on top afterwards; only LoRA tensors are trained and saved. With per-stage loading each
rank loads and quantizes only its own stage, so the full-precision model is never in memory whole; a plugin
without per-stage loading loads the whole model first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffpipe_core.engine.model_loading import keeps_float32

if TYPE_CHECKING:
    from diffpipe_core.engine.model_loading import StageModel
    from diffpipe_core.types import ModelConfigBase

MODES = ("nf4", "int8", "float8", "float8_e5m2")
FLOAT8_STORAGE = {"float8": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
MIN_ELEMENTS = 4096
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ScaledLinear(nn.Linear):
    """A frozen linear whose weight is stored in a low-precision dtype with its scale: ``weight.float() *
    weight_scale`` is the weight (one float32 scale for the tensor, or one per output row), computed in
    ``compute_dtype``. A quantized file (ComfyUI's fp8 scaled and int8 files) loads into one as it is stored
    (:meth:`like` builds the empty module); :class:`Float8Linear` quantizes one. peft wraps it like any
    ``nn.Linear``."""

    #: the buffers that are its weight: block swap moves them between host and device with the block
    stored_buffers: ClassVar[tuple[str, ...]] = ("weight", "weight_scale")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        weight: torch.Tensor,
        weight_scale: torch.Tensor | None,
        compute_dtype: torch.dtype,
        rotation: int = 0,
    ) -> None:
        nn.Module.__init__(self)  # no full-precision weight is made: the stored one is the only copy
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype, self.rotation = compute_dtype, rotation
        # buffers, not parameters: never trained, and nothing (a data-parallel broadcast) treats them as weights
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def like(
        cls,
        linear: nn.Linear,
        storage: torch.dtype,
        scale_shape: tuple[int, ...] | None,
        compute_dtype: torch.dtype,
        rotation: int = 0,
    ) -> ScaledLinear:
        """An empty module of ``linear``'s shape on its device (``meta`` for per-stage loading), weight in ``storage``,
        its bias as ``linear``'s; ``scale_shape`` None: no scale (1); ``rotation``: the weight is stored rotated in
        Hadamard groups of that many inputs (ComfyUI's int8 "convrot"), 0: not."""
        device = linear.weight.device
        weight = torch.empty(linear.out_features, linear.in_features, dtype=storage, device=device)
        scale = None if scale_shape is None else torch.ones(scale_shape, dtype=torch.float32, device=device)
        return cls(linear.in_features, linear.out_features, linear.bias, weight, scale, compute_dtype, rotation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        stored, scale = self.weight, self.weight_scale
        out = _StoredWeightMatmul.apply(x.to(self.compute_dtype), self._dequantize, stored, scale, bias)
        return out.to(x.dtype)

    def _dequantize(self, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if not self.rotation:
            return _dequantized(weight, scale, dtype)
        from diffpipe_core.quantized_files import dequantize

        return dequantize(weight, scale, dtype, self.rotation)


def _dequantized(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    value = weight.to(dtype)
    return value if scale is None else value * scale.to(dtype)


class _StoredWeightMatmul(torch.autograd.Function):
    """``x @ W.T + bias`` for a frozen weight ``W = dequantize(weight, scale)`` kept stored (float8 or int8 with its
    scale, GGUF blocks). Autograd through the plain expression would keep each layer's dequantized weight (2 bytes a
    weight in bf16) from forward to backward, more than the stored copy saves; this keeps only the stored weight and
    dequantizes it again for the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dequantize: Any, weight: torch.Tensor, scale: Any, bias: Any) -> Any:
        ctx.dequantize = dequantize
        ctx.save_for_backward(weight, scale)  # the module's own buffers: nothing new is kept
        return F.linear(x, dequantize(weight, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        weight, scale = ctx.saved_tensors
        grad_x = grad @ ctx.dequantize(weight, scale, grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None  # the weight, its scale and the bias are frozen


class GGUFLinear(nn.Linear):
    """A frozen linear whose weight is a GGUF file's quantized blocks (``Q8_0``, ``Q4_K``, ...), kept as its raw bytes
    (``(out_features, bytes per row)`` uint8) and dequantized in each forward (diffusers' GGUF dequantization), computed
    in ``compute_dtype``. :meth:`like` builds the empty module per-stage loading fills."""

    stored_buffers: ClassVar[tuple[str, ...]] = ("weight",)  # as ScaledLinear's

    def __init__(self, linear: nn.Linear, kind: str, row_bytes: int, compute_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kind, self.compute_dtype = kind, compute_dtype
        device = linear.weight.device
        self.register_buffer("weight", torch.empty(linear.out_features, row_bytes, dtype=torch.uint8, device=device))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @classmethod
    def like(cls, linear: nn.Linear, kind: str, compute_dtype: torch.dtype) -> GGUFLinear:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        return cls(linear, kind, linear.in_features // block * size, compute_dtype)

    def _dequantize(self, weight: torch.Tensor, scale: None, dtype: torch.dtype) -> torch.Tensor:
        from diffpipe_core.weight_files import gguf_dequantize

        return gguf_dequantize(weight, self.kind).reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = _StoredWeightMatmul.apply(x.to(self.compute_dtype), self._dequantize, self.weight, None, bias)
        return out.to(x.dtype)


class Float8Linear(ScaledLinear):
    """A frozen linear quantized to ``storage`` (float8_e4m3fn or float8_e5m2) with a per-tensor scale (``[model]
    quantize = "float8"`` / ``"float8_e5m2"``)."""

    def __init__(
        self, linear: nn.Linear, compute_dtype: torch.dtype, storage: torch.dtype = torch.float8_e4m3fn
    ) -> None:
        weight = linear.weight.detach()
        amax = weight.abs().amax().float().clamp(min=torch.finfo(torch.float32).tiny)
        scale = amax / torch.finfo(storage).max
        stored = (weight.float() / scale).to(storage)
        super().__init__(linear.in_features, linear.out_features, linear.bias, stored, scale.reshape(()), compute_dtype)


def quantizable_linears(
    model: nn.Module, layer: nn.Module, names: dict[int, str] | None = None
) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """The linears of block layer ``layer`` that ``quantize`` replaces, and those it leaves (fewer than
    :data:`MIN_ELEMENTS` weights, or kept in float32 by the model), each module once. ``names``: ``{id(module):
    name}`` of ``model``'s modules, when the caller has it (made here otherwise)."""
    if names is None:
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    chosen: list[nn.Linear] = []
    left: list[nn.Linear] = []
    seen: set[int] = set()
    for module in layer.modules():
        if type(module) is not nn.Linear or id(module) in seen:
            continue
        seen.add(id(module))
        small = module.weight.numel() < MIN_ELEMENTS
        (left if small or keeps_float32(model, f"{names.get(id(module), '')}.weight") else chosen).append(module)
    return chosen, left


def quantized_weight_bytes(mode: str, out_features: int, in_features: int) -> int:
    """Bytes a ``mode`` quantized weight of that shape takes, scales included (its bias keeps its dtype)."""
    n = out_features * in_features
    if mode == "nf4":  # two weights a byte, one uint8 absmax per 64 (nested: float32 per 256 blocks), code tables
        blocks = -(-n // 64)
        return -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4 * (16 + 256)
    if mode == "int8":  # plus one float32 scale per output row
        return n + 4 * out_features
    return n + 4  # float8 (either storage): one float32 scale


def _quantized(linear: nn.Linear, mode: str, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    if mode in FLOAT8_STORAGE:
        return Float8Linear(linear, compute_dtype, FLOAT8_STORAGE[mode])
    import bitsandbytes as bnb

    has_bias = linear.bias is not None
    if mode == "nf4":
        q = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=has_bias, compute_dtype=compute_dtype,
            quant_type="nf4", device="meta",
        )  # fmt: skip
        q.weight = bnb.nn.Params4bit(linear.weight.detach(), requires_grad=False, quant_type="nf4")
    else:
        q = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, device="meta"
        )
        q.weight = bnb.nn.Int8Params(linear.weight.detach(), requires_grad=False, has_fp16_weights=False)
    if has_bias:
        q.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return q.to(device)  # bitsandbytes quantizes when the weight is moved to a device


def quantize_stage(
    model_config: ModelConfigBase,
    stage: StageModel,
    layer_indices: Iterable[int],
    block_layers: Sequence[str],
    label: str | None = None,
) -> str | None:
    """Replace the linears of the block layers (class names ``block_layers``) among ``stage.layers[layer_indices]``
    (already loaded) by ``model_config.quantize`` modules, everywhere the model or a layer holds them; each is
    quantized on the device its weight is on. Returns a one-line summary (printed as a diffpipe line when
    ``label`` is given, e.g. ``"stage 0"``), or None when the run does not quantize."""
    counts = _quantize_layers(model_config, stage, layer_indices, block_layers)
    if counts is None:
        return None
    return _summary(model_config.quantize, counts, label)


def _summary(mode: str, counts: tuple[int, int, int, int], label: str | None) -> str:
    replaced, kept, before, after = counts
    summary = (
        f"{replaced} linear layers quantized to {mode} ({before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB), "
        f"{kept} small or float32-kept ones left as they were"
    )
    if label is not None:
        print(f"diffpipe: {label}: {summary}", flush=True)
    return summary


def load_quantized(
    model_config: ModelConfigBase,
    stage: StageModel,
    layer_indices: Sequence[int],
    block_layers: Sequence[str],
    load: Callable[[list[int]], None],
    label: str | None = None,
) -> str | None:
    """Load ``stage.layers[layer_indices]`` with ``load`` (a list of layer indices -> their weights filled in) and
    quantize them as :func:`quantize_stage` does, one block at a time: each block is quantized right after it is
    read, so the full-precision transient of a quantized base is one block's weights, not the stage's (what the stage
    plan counts: :mod:`diffpipe_core.engine.gpu_fit`). The other layers are loaded first, together."""
    if getattr(model_config, "quantize", None) is None:
        load(list(layer_indices))
        return None
    blocks = [i for i in layer_indices if type(stage.layers[i]).__name__ in block_layers]
    load([i for i in layer_indices if i not in blocks])
    total = (0, 0, 0, 0)
    for i in blocks:
        load([i])
        counts = _quantize_layers(model_config, stage, [i], block_layers)
        total = tuple(a + b for a, b in zip(total, counts or (0, 0, 0, 0)))  # type: ignore[assignment]
    return _summary(model_config.quantize, total, label)  # type: ignore[arg-type]


def _quantize_layers(
    model_config: ModelConfigBase, stage: StageModel, layer_indices: Iterable[int], block_layers: Sequence[str]
) -> tuple[int, int, int, int] | None:
    """Quantize the block layers among ``layer_indices``: (linears replaced, left, bytes before, after)."""
    mode = getattr(model_config, "quantize", None)
    if mode is None:
        return None
    layer_indices = [i for i in layer_indices if type(stage.layers[i]).__name__ in block_layers]
    compute_dtype = DTYPES[model_config.dtype]
    targets: dict[int, nn.Linear] = {}
    kept = 0
    for i in layer_indices:
        chosen, left = quantizable_linears(stage.model, stage.layers[i])
        kept += sum(1 for m in left if id(m) not in targets)
        targets.update((id(m), m) for m in chosen)
    replaced: dict[int, nn.Module] = {}
    before = after = 0
    parents = [stage.model, *(stage.layers[i] for i in layer_indices)]
    for parent_root in parents:
        for parent in parent_root.modules():
            for child_name, child in list(parent.named_children()):
                if id(child) not in targets:
                    continue
                if id(child) not in replaced:
                    before += _bytes(child)
                    replaced[id(child)] = _quantized(child, mode, compute_dtype, child.weight.device)
                    after += _bytes(replaced[id(child)])
                setattr(parent, child_name, replaced[id(child)])
    return len(replaced), kept, before, after


def _bytes(module: nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    total = sum(t.numel() * t.element_size() for t in tensors)
    quant_state = getattr(getattr(module, "weight", None), "quant_state", None)  # nf4 block scales
    absmax = getattr(quant_state, "absmax", None)
    return total + (absmax.numel() * absmax.element_size() if torch.is_tensor(absmax) else 0)
