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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core.model_files import (
    IMAGE_PROCESSOR,
    TOKENIZER,
    WEIGHT_STEMS,
    check_diffusers_folder,
    diffusers_weight_files,
    pipeline_index,
    read_json,
    safetensors_keys,
)

if TYPE_CHECKING:
    import torch

    from diffpipe_core.parts.layout import KeyTable

__all__ = ["IMAGE_PROCESSOR", "TOKENIZER", "DiffusersFolder", "SizeMatch"]


@dataclass(frozen=True)
class SizeMatch:
    """Two components must fit together: ``component``'s config ``key`` equals the diffusion model's ``model_key``
    (``model_default`` when its config leaves it out). E.g. the T5's ``d_model`` = the transformer's
    ``caption_channels``; a dotted ``key`` reads a nested config (a VL model's ``text_config.hidden_size``)."""

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
        components: component folder -> accepted class name(s), or :data:`TOKENIZER` for a tokenizer folder
            (:data:`IMAGE_PROCESSOR` for an image processor's). The first class of each is the one :meth:`load`
            builds. A name is a diffusers or transformers class (``"AutoencoderKL"``) or ``"module:Class"`` for a
            class of the plugin's own (a diffusers ``ModelMixin`` / ``ConfigMixin`` saved with ``save_pretrained``);
            the folder's ``config.json`` names it ``"Class"``.
        model: the diffusion model's component (``"transformer"`` or ``"unet"``); also the LoRA key prefix. A model
            with several diffusion models (Wan 2.2 A14B's ``transformer_2``) names the one a run trains in the
            ``component`` arguments below.
        sizes: :class:`SizeMatch` checks between components.
        single_file_example: what an original-layout single file of this model is called, for messages.
        title: how messages call the model ("SDXL"); default ``model_name``.
        model_title: how messages call the diffusion model ("UNet"); default ``model``.
        single_file_hint: what a missing weight file's message suggests instead.
        file_layouts: component -> a function of its config returning the :class:`KeyTable` of its original layout,
            for a component given as a file in that layout (``[model] vae``, ``text_encoders``); files in diffusers'
            or transformers' names need none. An ``AutoencoderKL`` reads the LDM layout (Flux's ``ae.safetensors``)
            without one.
        file_optional: component -> prefixes of its tensors that a component file may leave out because diffpipe
            never runs them (a text encoder's language-model head or vision tower: ComfyUI's text encoder files hold
            the language model only); absent from a file, they load as zeros.
        text_encoders: components a ``[model] text_encoders`` file may give besides those named ``text_encoder*``
            and ``image_encoder*`` (OmniGen2's Qwen2.5-VL is its folder's ``mllm``).
        by_index: components whose built class is the one the folder's index names among the accepted ones
            (:meth:`component_class`): a model whose releases differ in that component's class (LTX-2.5's Gemma 4).
            Every other component builds the table's first class, whatever the index says.
    """

    model_name: str
    pipelines: tuple[str, ...]
    components: Mapping[str, str | tuple[str, ...]]
    model: str = "transformer"
    sizes: tuple[SizeMatch, ...] = ()
    single_file_example: str = ""
    title: str = ""
    model_title: str = ""
    single_file_hint: str = "give diffusion_model for an original-layout single file"
    file_layouts: Mapping[str, Callable[[Mapping[str, Any]], KeyTable]] = field(default_factory=dict)
    file_optional: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    text_encoders: tuple[str, ...] = ()
    by_index: tuple[str, ...] = ()
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
            also = " (also needed with a single-file checkpoint, for the model's sizes)" * (component == self.model)
            raise FileNotFoundError(
                f"{path}: not a diffusers {self.title or self.model_name} folder ({problem}); [model] path must be "
                f"one, with {component}/config.json{also}"
            )
        return data

    def model_config(self, path: Path, component: str | None = None) -> dict[str, Any]:
        """The diffusion model's (or ``component``'s) config without diffusers' private ``_`` keys, ready for
        ``from_config``."""
        return {k: v for k, v in self.config(path, component).items() if not k.startswith("_")}

    def weight_files(self, path: Path, component: str | None = None) -> list[Path]:
        """The diffusion model's (or ``component``'s) safetensors files in the folder (one file, or the shards of an
        index; the ``fp16`` variant where only it is there)."""
        component = component or self.model
        what = f"{self.model_title or self.model} weights" if component == self.model else f"{component} weights"
        hint = self.single_file_hint if component.startswith(self.model) else ""
        return diffusers_weight_files(Path(path) / component, hint, what)

    # ------------------------------------------------------------------------------------------ checks
    def problems(
        self,
        path: Path,
        single_file: Path | None = None,
        layout: KeyTable | None = None,
        markers: Sequence[str] = (),
        component: str | None = None,
        file_checked: bool = False,
    ) -> list[str]:
        """Everything wrong with the folder (and the single file), without reading a weight: one line each.
        ``component``: the diffusion model a run trains, when not :attr:`model`; ``file_checked``: the single file was
        checked against the model already (its keys fit), so only the folder is checked."""
        component = component or self.model
        found = check_diffusers_folder(Path(path), self.pipelines, self._config_names(), self.model_name)
        if found:
            return found
        found = self._size_problems(Path(path), component)
        if file_checked:
            return found
        if single_file is not None:
            return found + self._single_file_problems(Path(single_file), layout, markers, component)
        folder = Path(path) / component
        for stem in WEIGHT_STEMS:
            single = folder / f"{stem}.safetensors"
            if single.is_file():
                _, problem = safetensors_keys(single)
                expected = f"; expected the {self.model_name} {component}'s weights"
                return found + ([problem + expected] if problem else [])
            if (folder / f"{stem}.safetensors.index.json").is_file():
                return found
        hint = f", or {self.single_file_hint}" if markers else ""
        found.append(
            f"{folder}: no diffusion_pytorch_model.safetensors (or .index.json, or their .fp16 variant); expected the "
            f"{self.model_name} {component}'s weights{hint}"
        )
        return found

    def _single_file_problems(
        self, file: Path, layout: KeyTable | None, markers: Sequence[str], component: str
    ) -> list[str]:
        what = f"a {self.model_name} {component} in the {layout.name if layout else 'original'} key layout"
        if self.single_file_example:
            what += f" ({self.single_file_example})"
        keys, problem = safetensors_keys(file)
        if problem:
            return [f"{problem}; expected {what}"]
        strip = layout.strip if layout is not None else (lambda k: k)
        names = {strip(k) for k in keys} | set(keys)  # a marker may name the file's prefix
        absent = [m for m in markers if m not in names]
        if not absent:
            return []
        hint = ""
        if any(k.startswith(("transformer_blocks.", "proj_in.", "x_embedder.")) for k in names):
            hint = f" (this looks like a diffusers-layout file: put it in path/{component}/)"
        return [
            f"{file}: no {absent[0]!r} among its {len(keys)} keys (e.g. {', '.join(keys[:3])}); expected {what}{hint}"
        ]

    def _size_problems(self, path: Path, component: str) -> list[str]:
        model, _ = read_json(path / component / "config.json")
        found = []
        for match in self.sizes:
            other, _ = read_json(path / match.component / "config.json")
            value = _nested(other, match.key)
            if model is None or value is None:
                continue
            want = model.get(match.model_key, match.model_default)
            if value != want:
                found.append(
                    f"{path / match.component / 'config.json'}: {match.key} is {value}, but "
                    f"{path / component / 'config.json'} has {match.model_key} {want}; the components are from "
                    "different models"
                )
        return found

    # ------------------------------------------------------------------------------------------ loading
    def component_class(self, component: str, path: Path | None = None) -> str:
        """The class :meth:`load` builds for ``component``: for a component of :attr:`by_index`, the one the folder
        at ``path`` names in its ``model_index.json`` (or ``modular_model_index.json``) when it is among the
        accepted ones; else the table's first."""
        accepted = self._classes[component]
        if path is not None and component in self.by_index:
            index, _ = read_json(pipeline_index(Path(path)))
            entry = (index or {}).get(component)
            if isinstance(entry, list) and len(entry) > 1 and entry[1] in accepted:
                return entry[1]
        return accepted[0]

    def load(
        self, path: Path, component: str, dtype: torch.dtype | None = None, device: Any = None, file: Any = None,
        quantization: Any = None,
    ) -> Any:
        """One component from its folder: a diffusers or transformers class by the table's first name (frozen,
        in eval mode, on ``device``), a tokenizer (``AutoTokenizer``) or an image processor
        (``AutoImageProcessor``). Only local files are read. ``file``: the component's weights come from this
        component file instead (a ``(ComponentFile, Fit)`` pair from :meth:`component_files`), its config from the
        folder. ``quantization``: a transformers ``BitsAndBytesConfig`` the folder's weights are quantized with as
        they are read (a transformers class only; :func:`diffpipe_core.parts.encoders.encoder_quantization`)."""
        if file is not None:
            from diffpipe_core.component_files import load_into

            component_file, fit = file
            model = load_into(self.skeleton(path, component, dtype), component_file, fit, component)
            return (model.to(device) if device is not None else model).eval().requires_grad_(False)
        folder = Path(path) / component
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{folder}: missing; [model] path must be a diffusers {self.model_name} folder with {component}/"
            )
        name = self.component_class(component, path)
        if name == TOKENIZER:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if name == IMAGE_PROCESSOR:
            from transformers import AutoImageProcessor

            return AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
        cls = find_class(name)
        kwargs: dict[str, Any] = {"local_files_only": True}
        if dtype is not None:
            kwargs["dtype"] = dtype
        if quantization is not None:  # bitsandbytes places the weights itself: no .to() afterwards
            kwargs.update(quantization_config=quantization, device_map=str(device if device is not None else "cpu"))
        module = cls.from_pretrained(str(folder), **kwargs)
        if device is not None and quantization is None:
            module = module.to(device)
        return module.eval().requires_grad_(False)


    def file_tables(self, path: Path, component: str) -> list[KeyTable]:
        """The original layouts a file of ``component`` may be in (:attr:`file_layouts`; the LDM VAE's for an
        ``AutoencoderKL``)."""
        config = self.model_config(path, component)
        if component in self.file_layouts:
            return [self.file_layouts[component](config)]
        if self.component_class(component) == "AutoencoderKL":
            from diffpipe_core.parts.ldm import vae_table

            return [vae_table(config, "")]
        return []

    def text_encoder_names(self) -> list[str]:
        """The components a ``[model] text_encoders`` file may give: every model component named ``text_encoder*``,
        and ``image_encoder*`` (the CLIP vision encoder of an image-to-video model, ComfyUI's ``clip_vision_*``), and
        those :attr:`text_encoders` names."""
        encoders = ("text_encoder", "image_encoder")
        return [n for n, c in self._classes.items()
                if (n.startswith(encoders) or n in self.text_encoders) and c[0] not in (TOKENIZER,)]

    def component_files(self, path: Path, model_config: Any) -> dict[str, Any]:
        """The components ``[model] vae``, ``audio_vae`` and ``text_encoders`` give as files, each as a
        ``(ComponentFile, Fit)`` pair for :meth:`load`: which text encoder a file holds, and the layout of every
        file, are read from its tensors against the component's config. Raises ValueError naming the key and the
        file when a file fits nothing it could be, or when the model has no such component."""
        import torch

        from diffpipe_core.component_files import (
            assign_text_encoders,
            fit_file,
            model_shapes,
            read_component_file,
            tied_names,
        )

        found: dict[str, Any] = {}
        for key in ("vae", "audio_vae"):
            file = getattr(model_config, key, None)
            if file is None:
                continue
            if key not in self._classes:
                raise ValueError(f"model.{key}: {self.title or self.model_name} has no {key.replace('_', ' ')}")
            header = read_component_file(file, key)
            skeleton = self.skeleton(path, key, torch.float32)
            shapes = model_shapes(skeleton)
            fit = fit_file(
                header, shapes, self.file_tables(path, key), tied_names(skeleton), self.file_optional.get(key, ())
            )
            if fit is None or not fit.complete:
                got = f"fills {fit.covered} of its {fit.total} tensors, not {', '.join(fit.missing)}" if fit else (
                    "fits none of its tensors"
                )
                raise ValueError(
                    f"model.{key}: {file}: not the {self.title or self.model_name} {key.replace('_', ' ')} of "
                    f"{Path(path) / key / 'config.json'} (read as diffusers' names or the original layout, it {got}; "
                    f"its keys begin {', '.join(list(header.weights)[:3])})"
                )
            found[key] = (header, fit)
        entries = tuple(getattr(model_config, "text_encoders", ()) or ())
        if entries:
            names = [n for n in self.text_encoder_names() if (Path(path) / n / "config.json").is_file()]
            if not names:
                raise ValueError(f"model.text_encoders: {self.title or self.model_name} has no text encoder")
            files = [(f"text_encoders[{i}]", e if isinstance(e, Path) else e.path) for i, e in enumerate(entries)]
            skeletons = {n: self.skeleton(path, n, torch.float32) for n in names}
            describe = {n: f"{type(m).__name__}, {_count(m)} parameters" for n, m in skeletons.items()}
            shapes = {n: model_shapes(m) for n, m in skeletons.items()}
            tied = {n: tied_names(m) for n, m in skeletons.items()}
            tables = {n: self.file_tables(path, n) for n in names}  # an original layout declared in file_layouts
            found.update(assign_text_encoders(files, shapes, describe, tied, self.file_optional, tables))
        return found

    def skeleton(self, path: Path, component: str, dtype: torch.dtype) -> Any:
        """``component`` from its config with its parameters on the meta device and its buffers real (a buffer no
        file holds, CLIP's ``position_ids``, keeps its value), cast as ``from_pretrained(torch_dtype=dtype)`` casts."""
        import torch
        from accelerate import init_empty_weights

        from diffpipe_core.engine.model_loading import cast_skeleton

        cls, where = find_class(self.component_class(component, path)), str(Path(path) / component)
        computed = {}
        with init_empty_weights():
            if hasattr(cls, "config_class"):  # transformers: built under the load dtype, as from_pretrained builds
                default = torch.get_default_dtype()  # it, so the buffers it computes (rotary inv_freq in float32,
                torch.set_default_dtype(dtype)  # Gemma's embed_scale in the load dtype) are its own
                try:
                    model = cls(cls.config_class.from_pretrained(where))
                finally:
                    torch.set_default_dtype(default)
                computed = {
                    (m, n): b for m in model.modules() for n, b in m._buffers.items()
                    if n in m._non_persistent_buffers_set
                }
            else:
                model = cls.from_config(cls.load_config(where))
        if hasattr(model, "tie_weights"):  # one tensor under both names (T5's shared and embed_tokens), as files
            model.tie_weights()  # hold it (outside init_empty_weights, which would register a copy)
        model = cast_skeleton(model, dtype)
        for (module, name), buffer in computed.items():  # no file holds them; from_pretrained leaves them as made
            module._buffers[name] = buffer
        return model

    def load_original(
        self, path: Path, component: str, file: Path, table: KeyTable, dtype: torch.dtype, device: Any = None
    ) -> Any:
        """``component`` (sized from ``path``'s config) from an original single file through its key table, frozen,
        in eval mode, on ``device``. Missing, unexpected or misshapen tensors raise, naming the file and the key."""
        from safetensors import safe_open

        model = self.skeleton(path, component, dtype)
        target = model.state_dict()
        with safe_open(str(file), framework="pt") as f:
            keys = [k for k in f.keys() if k.startswith(table.read_prefixes)]
            if not keys:
                raise ValueError(f"{file}: no {component} tensors (keys starting with {table.read_prefixes[0]!r})")
            shapes = {k: tuple(v.shape) for k, v in target.items()}
            state = table.to_model({k: f.get_tensor(k) for k in keys}, str(file), shapes)
        model.load_state_dict({k: v.to(target[k].dtype) for k, v in state.items()}, assign=True)
        return (model.to(device) if device is not None else model).eval().requires_grad_(False)

    def original_state(self, path: Path, component: str, table: KeyTable) -> dict[str, torch.Tensor]:
        """The folder's ``component`` in an original layout (``table.to_original``), for a single-file export."""
        state = self.load(path, component).state_dict()
        return table.to_original({k: v.contiguous() for k, v in state.items()})

    def component_weights(self, path: Path, component: str) -> list[tuple[Path, Any]]:
        """A component's safetensors files in the folder (transformers' ``model.safetensors`` or its shards, else the
        diffusers files) with a key map naming its tensors under ``<component>.``, for per-stage loading of a
        component held by the diffusion model (text encoders trained with it)."""
        folder = Path(path) / component
        index, _ = read_json(folder / "model.safetensors.index.json")
        if index is not None:
            files = [folder / f for f in sorted(set(index.get("weight_map", {}).values()))]
        elif (folder / "model.safetensors").is_file():
            files = [folder / "model.safetensors"]
        else:
            files = diffusers_weight_files(folder, what=f"{component} weights")
        return [(f, lambda key, c=component: f"{c}.{key}") for f in files]


def _nested(config: Mapping[str, Any] | None, key: str) -> Any:
    """``config[a][b]`` for the dotted ``key`` ``"a.b"``; None where any part is missing."""
    for part in key.split("."):
        if not isinstance(config, Mapping) or part not in config:
            return None
        config = config[part]
    return config


def _count(model: Any) -> str:
    from diffpipe_core.component_files import human_count

    return human_count(sum(t.numel() for t in model.parameters()))


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



