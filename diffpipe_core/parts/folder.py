"""A diffusers pipeline folder described as a table of components, and everything read from that table.

    FLUX = DiffusersFolder(
        model_name="flux",
        pipelines=("FluxPipeline", "FluxKontextPipeline"),
        components={"transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL",
                    "text_encoder": "CLIPTextModel", "tokenizer": TOKENIZER, ...},
    )

From it come the ``validate_model_files`` checks (``model_index.json``'s pipeline class, each component folder with
its class, the diffusion model's weight files, an original-layout single file's keys), the one config reader
(:meth:`DiffusersFolder.config`), the weight files for per-stage loading and component loading by class name
(:meth:`DiffusersFolder.load`). Reading the table imports no torch: ``diffpipe validate`` runs in well under a second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core.model_files import (
    TOKENIZER,
    check_diffusers_folder,
    diffusers_weight_files,
    read_json,
    safetensors_keys,
)

if TYPE_CHECKING:
    import torch

    from diffpipe_core.parts.layout import KeyTable

__all__ = ["TOKENIZER", "DiffusersFolder", "SizeMatch"]


@dataclass(frozen=True)
class SizeMatch:
    """Two components must fit together: ``component``'s config ``key`` equals the diffusion model's ``model_key``
    (``model_default`` when its config leaves it out). E.g. the T5's ``d_model`` = the transformer's
    ``caption_channels``."""

    component: str
    key: str
    model_key: str
    model_default: Any = None


@dataclass(frozen=True)
class DiffusersFolder:
    """The components of a model's diffusers folder.

    Attributes:
        model_name: the model (entry-point) name, for messages.
        pipelines: the ``model_index.json`` ``_class_name`` values accepted (the first is the usual one).
        components: component folder -> accepted class name(s), or :data:`TOKENIZER` for a tokenizer folder. The
            first class of each is the one :meth:`load` builds. A name is a diffusers or transformers class
            (``"AutoencoderKL"``) or ``"module:Class"`` for a class of the plugin's own (a diffusers ``ModelMixin`` /
            ``ConfigMixin`` saved with ``save_pretrained``); the folder's ``config.json`` names it ``"Class"``.
        model: the diffusion model's component (``"transformer"`` or ``"unet"``); also the LoRA key prefix.
        sizes: :class:`SizeMatch` checks between components.
        single_file_example: what an original-layout single file of this model is called, for messages.
    """

    model_name: str
    pipelines: tuple[str, ...]
    components: Mapping[str, str | tuple[str, ...]]
    model: str = "transformer"
    sizes: tuple[SizeMatch, ...] = ()
    single_file_example: str = ""
    _classes: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        classes = {k: (v,) if isinstance(v, str) else tuple(v) for k, v in self.components.items()}
        object.__setattr__(self, "_classes", classes)

    def _config_names(self) -> dict[str, tuple[str, ...]]:
        """The table as ``config.json`` names the classes (``"module:Class"`` -> ``"Class"``)."""
        return {k: tuple(c.rpartition(":")[2] for c in v) for k, v in self._classes.items()}

    # ------------------------------------------------------------------------------------------ reading
    def config(self, path: Path, component: str | None = None) -> dict[str, Any]:
        """``path/<component>/config.json`` (default: the diffusion model's); FileNotFoundError naming it."""
        component = component or self.model
        file = Path(path) / component / "config.json"
        data, problem = read_json(file)
        if data is None:
            raise FileNotFoundError(
                f"{problem}; [model] path must be a diffusers {self.model_name} folder with {component}/config.json"
                + (
                    " (also needed with a single-file checkpoint, for the model's sizes)"
                    if component == self.model
                    else ""
                )
            )
        return data

    def model_config(self, path: Path) -> dict[str, Any]:
        """The diffusion model's config without diffusers' private ``_`` keys, ready for ``from_config``."""
        return {k: v for k, v in self.config(path).items() if not k.startswith("_")}

    def weight_files(self, path: Path) -> list[Path]:
        """The diffusion model's safetensors files in the folder (one file, or the shards of an index)."""
        return diffusers_weight_files(
            Path(path) / self.model,
            "give transformer_file for an original-layout single file" if self.model == "transformer" else "",
        )

    # ------------------------------------------------------------------------------------------ checks
    def problems(
        self, path: Path, single_file: Path | None = None, layout: KeyTable | None = None, markers: Sequence[str] = ()
    ) -> list[str]:
        """Everything wrong with the folder (and the single file), without reading a weight: one line each."""
        found = check_diffusers_folder(Path(path), self.pipelines, self._config_names(), self.model_name)
        if found:
            return found
        found = self._size_problems(Path(path))
        if single_file is not None:
            return found + self._single_file_problems(Path(single_file), layout, markers)
        folder = Path(path) / self.model
        single = folder / "diffusion_pytorch_model.safetensors"
        if single.is_file():
            _, problem = safetensors_keys(single)
            return found + ([f"{problem}; expected the {self.model_name} {self.model}'s weights"] if problem else [])
        if not (folder / "diffusion_pytorch_model.safetensors.index.json").is_file():
            hint = ", or give transformer_file for an original-layout single file" if markers else ""
            found.append(
                f"{folder}: no diffusion_pytorch_model.safetensors (or .index.json); expected the {self.model_name} "
                f"{self.model}'s weights{hint}"
            )
        return found

    def _single_file_problems(self, file: Path, layout: KeyTable | None, markers: Sequence[str]) -> list[str]:
        what = f"a {self.model_name} {self.model} in the {layout.name if layout else 'original'} key layout"
        if self.single_file_example:
            what += f" ({self.single_file_example})"
        keys, problem = safetensors_keys(file)
        if problem:
            return [f"{problem}; expected {what}"]
        strip = layout.strip if layout is not None else (lambda k: k)
        names = {strip(k) for k in keys}
        absent = [m for m in markers if m not in names]
        if not absent:
            return []
        hint = ""
        if any(k.startswith(("transformer_blocks.", "proj_in.", "x_embedder.")) for k in names):
            hint = f" (this looks like a diffusers-layout file: put it in path/{self.model}/)"
        return [
            f"{file}: no {absent[0]!r} among its {len(keys)} keys (e.g. {', '.join(keys[:3])}); expected {what}{hint}"
        ]

    def _size_problems(self, path: Path) -> list[str]:
        model, _ = read_json(path / self.model / "config.json")
        found = []
        for match in self.sizes:
            other, _ = read_json(path / match.component / "config.json")
            if model is None or other is None or match.key not in other:
                continue
            want = model.get(match.model_key, match.model_default)
            if other[match.key] != want:
                found.append(
                    f"{path / match.component / 'config.json'}: {match.key} is {other[match.key]}, but "
                    f"{path / self.model / 'config.json'} has {match.model_key} {want}; the components are from "
                    "different models"
                )
        return found

    # ------------------------------------------------------------------------------------------ loading
    def component_class(self, component: str) -> str:
        return self._classes[component][0]

    def load(self, path: Path, component: str, dtype: torch.dtype | None = None, device: Any = None) -> Any:
        """One component from its folder: a diffusers or transformers class by the table's first name (frozen,
        in eval mode, on ``device``), or a tokenizer (``AutoTokenizer``). Only local files are read."""
        folder = Path(path) / component
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{folder}: missing; [model] path must be a diffusers {self.model_name} folder with {component}/"
            )
        name = self.component_class(component)
        if name == TOKENIZER:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        cls = find_class(name)
        kwargs: dict[str, Any] = {"local_files_only": True}
        if dtype is not None:
            kwargs["dtype"] = dtype
        module = cls.from_pretrained(str(folder), **kwargs)
        if device is not None:
            module = module.to(device)
        return module.eval().requires_grad_(False)


def find_class(name: str) -> Any:
    """The class ``name`` names: ``"module:Class"`` (imported), or a diffusers, then transformers, class name."""
    module, _, attr = name.rpartition(":")
    if module:
        import importlib

        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"class {name!r} cannot be imported: {exc}") from exc
    import diffusers
    import transformers

    for library in (diffusers, transformers):
        cls = getattr(library, name, None)
        if cls is not None:
            return cls
    raise ValueError(f"no diffusers or transformers class named {name!r} (a class of your own: 'module:Class')")


_find_class = find_class  # the name the shared parts used first
