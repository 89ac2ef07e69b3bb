"""One key-table converter for the original single-file layouts of diffusion models.

A model's original checkpoint (Black Forest Labs' Flux, Tencent's HunyuanVideo, Lightricks' LTX-Video, NVIDIA's
Cosmos, Stability's SGM UNet) names its modules differently from diffusers, and sometimes fuses several diffusers
linears into one tensor (``double_blocks.N.img_attn.qkv`` = ``to_q | to_k | to_v`` stacked along the output rows).
A plugin describes that once, as a :class:`KeyTable` of :class:`Module` entries sized from the transformer's
config, and everything else comes from here:

- :meth:`KeyTable.to_model`: a whole original state dict in the model's keys (loading a single file whole);
- :meth:`KeyTable.key_map`: the per-stage loading key map (``diffusion_model_weights``), which cuts a fused
  tensor only for the stage that needs one of its parts;
- :meth:`KeyTable.to_original`: the model's state dict in the original layout (``single_file`` exports);
- :meth:`KeyTable.lora_targets`: the fused LoRA targets of a ComfyUI-layout LoRA export
  (:func:`diffpipe_core.adapters.fused_lora_format`), under each module's ComfyUI name.

Sizes come from the table (built from the model's config), never from full-size constants, so tiny test models
and full-size checkpoints convert alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from diffpipe_core.adapters import FusedTarget

    Transform = Callable[[torch.Tensor], torch.Tensor]

#: parameters of a linear (and of most modules): the same names in both layouts
LINEAR = (("weight", "weight"), ("bias", "bias"))
#: an RMS norm whose original layout calls its weight ``scale`` (BFL's Flux)
SCALE_NORM = (("scale", "weight"),)
#: ``Module.comfy`` default: ComfyUI names the module as the original layout does
SAME = "="


class LayoutError(KeyError, ValueError):
    """A checkpoint's keys do not fit the key layout (an unexpected or a missing key): a KeyError (a key) that is
    also a ValueError (a bad file), so callers may catch either."""


@dataclass(frozen=True)
class Module:
    """``original`` (a module path in the original layout) is the model's ``parts`` stacked along dim 0.

    Attributes:
        original: the module path in the original layout (no file prefix).
        parts: the model's (diffusers') module paths, in stacking order; one part is a plain rename.
        sizes: output rows of each part when they differ (a single block's ``linear1`` = q, k, v, then the MLP);
            empty: equal parts.
        params: ``(original name, model name)`` of the parameters; None: whatever parameters the module has,
            under the same names (a rename of the module only; one part only).
        swap: dim 0 holds two halves in the opposite order in the original (Flux's final adaLN shift/scale).
        comfy: the module's name in ComfyUI's LoRA layout: :data:`SAME` (the original name), another name, or
            None when ComfyUI has no name a LoRA on this module could use.
        form: how the original stores the module's tensors when not as the model does: ``"conv1x1"`` (a linear's
            weight as a 1x1 convolution's, LDM VAEs' attention), ``"conv1x1x1"`` (as a 1x1x1 3-D convolution's, video
            LDM VAEs' attention), ``"transposed"`` (OpenCLIP's ``text_projection``) or ``"flat6"`` (a ``(6, D)``
            table stored as one ``6 * D`` vector: Krea 2's per-block modulation) or ``"weight_norm"`` (a
            weight-normed module's ``weight_g`` / ``weight_v`` folded into one ``weight``, as ComfyUI's files hold
            them: read as ``weight_v`` = the weight and ``weight_g`` = its norm, which give the same weight; list
            the params ``(("weight", "weight_v"), ("bias", "bias"))``).
            ``original`` may be ``""`` for a parameter at the top of the original layout.
        groups: the original interleaves its equal parts per group (attention head) instead of stacking them:
            rows ``[group 0: part 0, part 1, ...; group 1: part 0, ...]`` (MiniMax H3's video VAE ``to_qkv``:
            ``[head 0: q k v; head 1: q k v; ...]``); 0: stacked.
    """

    original: str
    parts: tuple[str, ...]
    sizes: tuple[int, ...] = ()
    params: tuple[tuple[str, str], ...] | None = LINEAR
    swap: bool = False
    comfy: str | None = SAME
    form: str = ""
    groups: int = 0

    def __post_init__(self) -> None:
        if self.sizes and len(self.sizes) != len(self.parts):
            raise ValueError(f"{self.original}: {len(self.sizes)} sizes for {len(self.parts)} parts")
        if self.groups and (self.sizes or len(self.parts) < 2):
            raise ValueError(f"{self.original}: interleaved groups need two or more equal parts")
        if self.params is None and len(self.parts) != 1:
            raise ValueError(f"{self.original}: a fused module must list its parameters")
        if self.form not in FORMS or (self.form and len(self.parts) != 1):
            raise ValueError(f"{self.original}: form {self.form!r} needs one part and one of {list(FORMS)[1:]}")

    @property
    def comfy_name(self) -> str | None:
        return self.original if self.comfy == SAME else self.comfy


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    import torch

    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _to_conv1x1(t: torch.Tensor) -> torch.Tensor:
    return t[:, :, None, None] if t.dim() == 2 else t


def _to_conv1x1x1(t: torch.Tensor) -> torch.Tensor:
    return t[:, :, None, None, None] if t.dim() == 2 else t


def _from_conv1x1(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1) if t.dim() > 2 else t


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.T.contiguous()


def _from_flat6(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(6, -1) if t.dim() == 1 else t


def _to_flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


#: ``Module.form`` -> (original tensor -> model tensor, model tensor -> original tensor)
FORMS: dict[str, tuple[Callable[[Any], Any] | None, Callable[[Any], Any] | None]] = {
    "": (None, None),
    "conv1x1": (_from_conv1x1, _to_conv1x1),
    "conv1x1x1": (_from_conv1x1, _to_conv1x1x1),
    "transposed": (_transpose, _transpose),
    "flat6": (_from_flat6, _to_flat),
    "weight_norm": (None, None),  # two model tensors of one: KeyTable.targets / to_original
}

WEIGHT_NORM = "weight_norm"


def _weight_norm_g(t: torch.Tensor) -> torch.Tensor:
    """``weight_g`` of a folded weight: its norm over all dims but 0 (``torch.nn.utils.weight_norm``'s ``dim=0``)."""
    import torch

    return torch.norm_except_dim(t, 2, 0)


def _piece(index: int, count: int, sizes: tuple[int, ...], groups: int = 0) -> Transform:
    """Part ``index`` of ``count`` stacked along dim 0 (equal parts, or of ``sizes`` rows), or with ``groups``,
    interleaved per group (:attr:`Module.groups`)."""

    def take(t: torch.Tensor) -> torch.Tensor:
        import torch

        if groups:
            grouped = t.reshape(groups, count, t.shape[0] // (groups * count), *t.shape[1:])
            return grouped[:, index].reshape(t.shape[0] // count, *t.shape[1:]).contiguous()
        rows = list(sizes) if sizes else [t.shape[0] // count] * count
        return torch.split(t, rows, dim=0)[index].contiguous()

    return take


def _interleave(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Equal ``parts`` interleaved per group along dim 0 (the inverse of :func:`_piece` with ``groups``)."""
    import torch

    split = [p.reshape(groups, p.shape[0] // groups, *p.shape[1:]) for p in parts]
    return torch.stack(split, dim=1).reshape(sum(p.shape[0] for p in parts), *parts[0].shape[1:])


def _split_key(key: str) -> tuple[str, str]:
    module, _, param = key.rpartition(".")
    return module, param


def _join(module: str, param: str) -> str:
    return f"{module}.{param}" if module else param


def _single(entry: Module) -> Transform | None:
    """The transform of a one-part module's tensor on read (its ``swap`` or ``form``), or None."""
    return _swap_halves if entry.swap else FORMS[entry.form][0]


@dataclass(frozen=True)
class KeyTable:
    """A model's original key layout: its modules, the prefixes its files use, and what is not the model's.

    Attributes:
        modules: every module the two layouts name differently (and every fused one).
        name: what the layout is, for messages ("BFL", "original Tencent", ...).
        model: the model's name, for messages ("Flux transformer").
        read_prefixes: prefixes a file may hold the model under (``"model.diffusion_model."``), stripped on read.
        write_prefix: the prefix :meth:`to_original` writes keys under (``"net."`` for Cosmos); default none.
        renames: ``(original prefix, model prefix)`` pairs renaming whole subtrees (LTX-Video's
            ``adaln_single.*`` = ``time_embed.*``) or single keys, for keys that are no parameter of a module in
            ``modules``; the first match wins (list a more specific prefix first). A model of many modules whose
            only difference is their names (the SGM UNet) is a table of renames alone.
        passthrough: keys of modules neither in ``modules`` nor under ``renames`` keep their names (layouts that
            differ by a few renames); False: such keys are unexpected.
        skip: a regular expression of original keys that are not the model's and are dropped on read
            (training-only tensors such as ``logvar.*``).
        foreign_prefixes: with a file that holds the model under one of ``read_prefixes``, keys under none of them
            belong to other parts (a VAE, text encoders) and are ignored.
    """

    modules: tuple[Module, ...]
    name: str = "original"
    model: str = "transformer"
    read_prefixes: tuple[str, ...] = ("model.diffusion_model.", "diffusion_model.")
    write_prefix: str = ""
    renames: tuple[tuple[str, str], ...] = ()
    passthrough: bool = False
    skip: str | None = None
    _by_original: dict[str, Module] = field(init=False, repr=False, compare=False)
    _by_part: dict[str, tuple[Module, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_original = {m.original: m for m in self.modules}
        by_part = {p: (m, i) for m in self.modules for i, p in enumerate(m.parts)}
        object.__setattr__(self, "_by_original", by_original)
        object.__setattr__(self, "_by_part", by_part)

    # ------------------------------------------------------------------------------------------ reading
    def strip(self, key: str) -> str:
        for prefix in self.read_prefixes:
            if key.startswith(prefix):
                return key[len(prefix) :]
        return key

    def _skipped(self, bare: str) -> bool:
        return bool(self.skip and re.search(self.skip, bare))

    def targets(self, bare: str) -> list[tuple[str, Transform | None]] | None:
        """The model tensors made from original key ``bare`` (no prefix), each with the transform cutting it out
        of the original tensor (None: as is); None when the key is not the model's."""
        if self._skipped(bare):
            return None
        module, param = _split_key(bare)
        entry = self._by_original.get(module)
        model_param = None if entry is None else param if entry.params is None else dict(entry.params).get(param)
        if entry is None or model_param is None:  # not a table module's parameter: renamed, kept, or not the model's
            renamed = _rename(bare, self.renames)
            if renamed is not None:
                return [(renamed, None)]
            return [(bare, None)] if self.passthrough else None
        if entry.form == WEIGHT_NORM and model_param == "weight_v":
            return [(f"{entry.parts[0]}.weight_g", _weight_norm_g), (f"{entry.parts[0]}.weight_v", None)]
        if len(entry.parts) == 1:
            return [(f"{entry.parts[0]}.{model_param}", _single(entry))]
        count = len(entry.parts)
        return [(f"{p}.{model_param}", _piece(i, count, entry.sizes, entry.groups)) for i, p in enumerate(entry.parts)]

    def key_map(self, file_keys: Iterable[str] | None = None, under: str = "") -> Callable[[str], Any]:
        """The per-stage loading key map of a file in this layout: a file key -> the model tensors it makes (see
        :meth:`targets`; a plain rename as the model's name), None for a key that is not the model's. With
        ``file_keys`` given and one of them under a ``read_prefixes`` entry, keys under no prefix belong to other
        parts of the file and map to None. ``under``: the names are of a submodule held there (``"text_encoder"``)."""
        prefixed = file_keys is not None and any(k.startswith(self.read_prefixes) for k in file_keys)
        head = f"{under}." if under else ""

        def mapped(key: str) -> Any:
            if prefixed and not key.startswith(self.read_prefixes):
                return None
            made = self.targets(self.strip(key))
            if made and len(made) == 1 and made[0][1] is None:
                return head + made[0][0]
            return made and [(head + name, fn) for name, fn in made]

        return mapped

    def own_keys(self, file_keys: Iterable[str]) -> list[str]:
        """The keys of a file that hold the model: those under a ``read_prefixes`` entry when the file has any (the
        rest belong to other parts, a VAE or text encoders), else every key."""
        keys = list(file_keys)
        prefixed = [k for k in keys if k.startswith(self.read_prefixes)]
        return prefixed or keys

    def to_model(
        self,
        state: Mapping[str, torch.Tensor],
        source: str = "checkpoint",
        expected: Mapping[str, tuple[int, ...]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """An original-layout state dict (keys optionally under a read prefix) in the model's keys.

        A key that is not the model's raises a KeyError naming ``source`` and the key. With ``expected`` (the
        model's ``{key: shape}``), a missing tensor raises a KeyError naming its original key, and a tensor of the
        wrong shape a ValueError naming both keys and both shapes."""
        out: dict[str, torch.Tensor] = {}
        origin: dict[str, str] = {}
        unexpected = []
        for key in self.own_keys(state):
            bare = self.strip(key)
            if self._skipped(bare):
                continue
            made = self.targets(bare)
            if made is None:
                unexpected.append(bare)  # named as the layout's tables name it, without the file's prefix
                continue
            for name, transform in made:
                out[name] = transform(state[key]) if transform else state[key]
                origin[name] = key
        if unexpected:
            more = f" (and {len(unexpected) - 1} more, e.g. {unexpected[1:4]})" if len(unexpected) > 1 else ""
            raise LayoutError(
                f"{source}: unexpected key {unexpected[0]!r}{more} for a {self.model} in the {self.name} layout"
            )
        if expected is not None:
            missing = sorted(set(expected) - set(out))
            if missing:
                raise LayoutError(
                    f"{source}: missing key {self.original_key(missing[0])!r} ({missing[0]}; {len(missing)} missing "
                    f"in all); is this a {self.model} in the {self.name} layout?"
                )
            extra = sorted(set(out) - set(expected))
            if extra:
                raise LayoutError(
                    f"{source}: unexpected key {origin[extra[0]]!r} for a {self.model} of this config ({len(extra)} "
                    f"in all, e.g. {extra[:3]})"
                )
            for name, value in out.items():
                if tuple(value.shape) != tuple(expected[name]):
                    raise ValueError(
                        f"{source}: {name!r} has shape {tuple(value.shape)}, the config needs {tuple(expected[name])} "
                        f"(size mismatch for {name}, from file tensor {origin[name]!r} of shape "
                        f"{tuple(state[origin[name]].shape)})"
                    )
        return out

    # ------------------------------------------------------------------------------------------ writing
    def original_key(self, model_key: str) -> str:
        """The original key (no prefix) holding model tensor ``model_key`` (whole, or as one fused part)."""
        module, param = _split_key(model_key)
        found = self._by_part.get(module)
        if found is None:
            return _rename(model_key, tuple((m, o) for o, m in self.renames)) or model_key
        entry, _ = found
        if entry.params is None:
            return _join(entry.original, param)
        return _join(entry.original, {m: o for o, m in entry.params}.get(param, param))

    def to_original(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's state dict in the original layout (fused parts stacked), keys under ``write_prefix``.
        A model tensor with no original counterpart (or a fused module with a part missing) raises a KeyError
        naming it."""
        import torch

        out: dict[str, torch.Tensor] = {}
        groups: dict[tuple[str, str], Module] = {}
        unknown = []
        reverse_renames = tuple((m, o) for o, m in self.renames)
        for key, value in state.items():
            module, param = _split_key(key)
            found = self._by_part.get(module)
            if found is None:
                renamed = _rename(key, reverse_renames) or (key if self.passthrough else None)
                if renamed is None:
                    unknown.append(key)
                else:
                    out[self.write_prefix + renamed] = value
                continue
            entry, _ = found
            original_param = param if entry.params is None else {m: o for o, m in entry.params}.get(param)
            if entry.form == WEIGHT_NORM and param in ("weight_g", "weight_v"):
                if param == "weight_v":  # the weight weight_g and weight_v give
                    g = state[f"{module}.weight_g"]
                    out[self.write_prefix + _join(entry.original, "weight")] = torch._weight_norm(value, g, 0)
                continue
            if original_param is None:
                unknown.append(key)
            elif len(entry.parts) == 1:
                write = _swap_halves if entry.swap else FORMS[entry.form][1]
                out[self.write_prefix + _join(entry.original, original_param)] = write(value) if write else value
            else:
                groups[(entry.original, original_param)] = entry
        if unknown:
            raise KeyError(
                f"{self.model} state dict has {len(unknown)} keys with no counterpart in the {self.name} layout, "
                f"e.g. {unknown[:3]}"
            )
        for (original, original_param), entry in groups.items():
            model_param = dict(entry.params or ())[original_param]
            names = [f"{p}.{model_param}" for p in entry.parts]
            missing = [n for n in names if n not in state]
            if missing:
                raise KeyError(f"{self.model} state dict lacks {missing[0]!r} (needed for {original}.{original_param})")
            parts = [state[n] for n in names]
            value = _interleave(parts, entry.groups) if entry.groups else torch.cat(parts, dim=0)
            out[self.write_prefix + _join(original, original_param)] = _swap_halves(value) if entry.swap else value
        return out

    # ------------------------------------------------------------------------------------------ LoRA
    def lora_targets(self, lora_modules: Iterable[str]) -> list[FusedTarget]:
        """The ComfyUI-layout targets of the modules a peft LoRA adapted (module paths of the model): one per
        table module with an adapted part and a ComfyUI name, in table order; adapted modules outside the table
        are renamed by ``renames`` (or keep their names with ``passthrough``). A module whose table entry has no
        ComfyUI name is left out (:func:`~diffpipe_core.adapters.fused_lora_format` then names it as having no
        counterpart)."""
        from diffpipe_core.adapters import FusedTarget

        adapted = set(lora_modules)
        targets = []
        covered: set[str] = set()
        for entry in self.modules:
            if entry.comfy_name is None or not adapted & set(entry.parts):
                continue
            if entry.groups:
                raise ValueError(f"{entry.original}: a LoRA of parts interleaved per group is not written")
            targets.append(FusedTarget(entry.comfy_name, entry.parts, entry.sizes))
            covered.update(entry.parts)
        reverse_renames = tuple((m, o) for o, m in self.renames)
        for module in sorted(adapted - covered):
            if module in self._by_part:
                continue
            name = _rename(module, reverse_renames) or (module if self.passthrough else None)
            if name is not None:
                targets.append(FusedTarget(name, (module,)))
        return targets


def _rename(key: str, renames: tuple[tuple[str, str], ...]) -> str | None:
    """``key`` with the first matching ``(from prefix, to prefix)`` applied (whole path components), or None."""
    for old, new in renames:
        if key == old or key.startswith(old + "."):
            return new + key[len(old) :]
    return None


def count_blocks(keys: Iterable[str], pattern: str) -> int:
    """``max(N) + 1`` over the keys matching ``pattern`` (its one group: the block index); 0 if none match."""
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0
