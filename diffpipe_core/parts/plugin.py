"""The base class of a model plugin on a diffusers model: declare what differs, implement only the model's own hooks.

    class Flux(DiffusersModel):
        spec = ModelSpec(name="flux", modality="image", config_schema=FluxConfig, ...)
        folder = DiffusersFolder(model_name="flux", pipelines=("FluxPipeline",), components={...})
        model_class = "FluxTransformer2DModel"
        single_file_name = "flux1-transformer.safetensors"
        key_tables = "diffpipe_flux.bfl"    # its layout_for_config / lora_layout: the original single-file layout

        @hookimpl
        def encode_batch(self, encoders, batch): ...      # settings: encoders.config (load_components)
        ...

    plugin = Flux()        # the entry point names this object: flux = "diffpipe_flux.plugin:plugin"

pluggy registers an instance's marked methods like a module's functions, so the base class's hooks
(``model_spec``, ``validate_model_files``, ``load_diffusion_model``, ``diffusion_model_weights``, ``lora_targets``,
``adapter_key_prefix``, ``export_adapter``, ``export_model``, ``compute_loss``) come from the declarations, and a
subclass writes ``load_encoders``, ``encode_batch``, ``split_into_layers``, ``prepare_inputs`` (and the sampling hooks,
if it samples). A method named like a hook must carry ``@hookimpl`` (the class refuses one that does not: pluggy
would silently skip it). This module imports no torch: the work happens inside the hooks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from diffpipe_core import hookimpl, hookspecs
from diffpipe_core.types import ModelConfigBase, ModelSpec, TrainingContext

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core.component_files import DiffusionModelFile
    from diffpipe_core.parts.folder import DiffusersFolder
    from diffpipe_core.parts.layout import KeyTable

#: the formats a diffusers-folder model saves by default: LoRA as diffusers and ComfyUI files, full fine-tunes as a
#: diffusers folder and an original-layout single file
SAVE_FORMATS = {"adapter_formats": ("diffusers", "comfyui"), "model_formats": ("diffusers", "single_file")}


def diffusers_spec(
    name: str,
    config_schema: type[ModelConfigBase],
    description: str,
    *,
    video: tuple[int, int, float] | None = None,
    encoder_settings: tuple[str, ...] = (),
    **fields: Any,
) -> ModelSpec:
    """The :class:`~diffpipe_core.types.ModelSpec` of a diffusers-folder model, stating only what differs.

    ``video`` is ``(frame_multiple, frame_offset, video_fps)`` of a video model (None: an image model). The cache is
    keyed on ``path``, ``encoder_dtype`` and ``encoder_settings``; the save formats are :data:`SAVE_FORMATS` unless
    ``fields`` names them. Every other ``ModelSpec`` field passes through ``fields``.
    """
    frames = {} if video is None else dict(zip(("frame_multiple", "frame_offset", "video_fps"), video, strict=True))
    return ModelSpec(
        name=name,
        modality="image" if video is None else "video",
        config_schema=config_schema,
        description=description,
        encoder_settings=("path", "encoder_dtype", *encoder_settings),
        **frames,
        **{**SAVE_FORMATS, **fields},
    )


_HOOKS = frozenset(name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), "diffpipe_spec"))


class DiffusersModel:
    """Hooks of a diffusers-backed model plugin, from its declarations (class attributes and small methods).

    Declare:
        spec: the :class:`~diffpipe_core.types.ModelSpec`.
        folder: the :class:`~diffpipe_core.parts.folder.DiffusersFolder` (components, pipeline classes).
        model_class: the class of the diffusion model: a diffusers class name (``"FluxTransformer2DModel"``) or
            ``"module:Class"`` for a model of the plugin's own (a diffusers ``ModelMixin`` + ``ConfigMixin``).
        single_file_key: the ``[model]`` key of an original-layout single file (None: the model has none).
        single_file_markers: original keys (without a file prefix) every such file holds; ``validate`` checks them.
        sibling_markers: other model types' markers, ``{type: (what it is, markers)}``: a single file holding
            them is named as that model's, with the ``type`` to train it with, by ``validate`` and on loading (Cosmos
            1.0 and Predict2 files, whose layouts share their prefix).
        single_file_name: the file name of a ``single_file`` export.
        lora_target_names: the default ``lora_targets``: exact module names or dotted suffixes (a module matches
            ``attn.to_q`` when its name is ``attn.to_q`` or ends with ``.attn.to_q``: peft's rule for a list), not
            regexes.
        last_block_unused: those of :attr:`lora_target_names` whose output the model's last joint block computes
            for nothing: nothing after it reads the block's text stream, so its text queries and text-side outputs
            are dead ends (Qwen-Image's ``attn.add_q_proj``, ``attn.to_add_out``, ``txt_mlp.net.0.proj``,
            ``txt_mlp.net.2``). The default targets then name those modules in every joint block but the last, by
            full name (a LoRA on them in the last block would get no gradient).
        joint_blocks: where those blocks are: ``(module list, config key of their count)``.
        encoder_components: the folder's components the default ``load_encoders`` loads for caching (the VAE, the
            text encoders, their tokenizers), in ``encoder_dtype``; ``encoders.config`` is the ``[model]`` table.
        sample_pipeline: the diffusers pipeline class whose samples this plugin's must equal (``"SanaPipeline"``); the
            conformance kit runs it on the tiny model and compares its latents with the core's loop over the plugin's
            layers, from the same noise (None: the model has no diffusers pipeline, nothing to compare with).
        sample_pipeline_settings: ``{pipeline call argument: [model] key}`` for the settings the pipeline takes as
            call arguments (``{"max_sequence_length": "text_max_length"}``).
        sample_pipeline_setup: optional ``(pipe, request) -> None`` the kit calls on the loaded pipeline before
            sampling, for what the pipeline needs beyond call arguments to sample at the request's size
            (HiDream's pipeline rescales every size to its own area unless its ``default_sample_size`` says so).
        tiny_writer: ``"module:function"`` of the function writing the model's tiny random-weight folder in its real
            layout (``function(folder) -> folder``), for tests, examples and bug reports:
            ``python -m diffpipe_core.testing.tiny_models TYPE DIR`` runs it (None: the model has none).

    and override :meth:`original_layout` when the model has an original single-file layout,
    :meth:`default_lora_targets` when the default targets depend on the config otherwise, :meth:`build_skeleton`
    when the model must be built differently from ``from_config``, :meth:`single_file` / :meth:`model_folder` when
    the ``[model]`` keys name the files differently (SDXL's ``path`` is a folder or a single file whose configs come
    from ``config_path``), and :meth:`model_component` when the folder holds several diffusion models of which a run
    trains one (Wan 2.2 A14B's ``transformer_2``).
    """

    spec: ClassVar[ModelSpec]
    folder: ClassVar[DiffusersFolder]
    model_class: ClassVar[str]
    single_file_key: ClassVar[str | None] = "diffusion_model"
    single_file_markers: ClassVar[tuple[str, ...]] = ()
    sibling_markers: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {}
    single_file_name: ClassVar[str] = "transformer.safetensors"
    lora_target_names: ClassVar[tuple[str, ...]] = ()
    last_block_unused: ClassVar[tuple[str, ...]] = ()
    joint_blocks: ClassVar[tuple[str, str]] = ("transformer_blocks", "num_layers")
    encoder_components: ClassVar[tuple[str, ...]] = ("vae", "text_encoder", "tokenizer")
    sample_pipeline: ClassVar[str | None] = None
    sample_pipeline_settings: ClassVar[dict[str, str]] = {}
    tiny_writer: ClassVar[str | None] = None
    #: The module holding the original single-file key tables: its ``layout_for_config(transformer_config)`` and
    #: ``lora_layout(state_dict)`` are :meth:`original_layout` and :meth:`lora_layout` (imported when first used).
    key_tables: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unmarked = [
            name
            for name, value in vars(cls).items()
            if name in _HOOKS and callable(value) and not hasattr(value, "diffpipe_impl")
        ]
        if unmarked:
            raise TypeError(
                f"{cls.__name__}.{unmarked[0]} is named like a diffpipe hook but lacks @hookimpl (pluggy would "
                "skip it); mark it, or rename it"
            )

    # ------------------------------------------------------------------------------------------ declarations
    def original_layout(self, transformer_config: dict[str, Any]) -> KeyTable | None:
        """The model's original single-file key layout, sized from the diffusion model's config; None: none
        (the default without :attr:`key_tables`)."""
        return import_module(self.key_tables).layout_for_config(transformer_config) if self.key_tables else None

    def original_layouts(self, transformer_config: dict[str, Any]) -> list[KeyTable]:
        """Every original layout a ``diffusion_model`` file may be in: the :attr:`key_tables` module's
        ``layouts_for_config(transformer_config)`` when it has one (a model shipped in several layouts, as
        HunyuanVideo-1.5 by Tencent and by ComfyUI), else :meth:`original_layout` alone."""
        module = import_module(self.key_tables) if self.key_tables else None
        if module is not None and hasattr(module, "layouts_for_config"):
            return list(module.layouts_for_config(transformer_config))
        layout = self.original_layout(transformer_config)
        return [layout] if layout is not None else []

    def default_lora_targets(self, model_config: ModelConfigBase) -> list[str]:
        """The default LoRA targets: :attr:`lora_target_names`, those in :attr:`last_block_unused` expanded to
        their full names in every joint block but the last (the list is unchanged when nothing is left out)."""
        if not self.last_block_unused:
            return list(self.lora_target_names)
        blocks, count_key = self.joint_blocks
        count = int(self.model_folder_config(model_config)[count_key])
        targets: list[str] = []
        for name in self.lora_target_names:
            if name in self.last_block_unused:
                targets += [f"{blocks}.{i}.{name}" for i in range(count - 1)]
            else:
                targets.append(name)
        return targets

    def single_file(self, model_config: ModelConfigBase) -> Path | None:
        """The configured original-layout single file, if any."""
        return getattr(model_config, self.single_file_key, None) if self.single_file_key else None

    def model_component(self, model_config: ModelConfigBase) -> str:
        """The folder component holding the diffusion model this run trains (default :attr:`folder`'s ``model``).
        Its config sizes the model, its weights are loaded, its config goes with a ``diffusers`` export, and a
        ``diffusion_model`` replaces its weights."""
        return self.folder.model

    def model_folder(self, model_config: ModelConfigBase) -> Path:
        """The diffusers folder the model's configs (and, without a single file, its weights) come from."""
        return Path(model_config.path)  # type: ignore[attr-defined]

    def model_folder_config(self, model_config: ModelConfigBase) -> dict[str, Any]:
        """The diffusion model's ``config.json`` (diffusers' private keys left out), with what :attr:`file_config`
        reads from a ``diffusion_model`` file's tensors where the file differs (a schnell file beside a dev folder)."""
        config = self.folder.model_config(self.model_folder(model_config), self.model_component(model_config))
        return {**config, **self.config_from_file(model_config, config)}

    #: Config keys read from a ``diffusion_model`` file's tensors, as ComfyUI's model detection reads them: key ->
    #: a regular expression searched in the file's keys (any layout, any prefix): with one group (a block index) the
    #: key is the block count, without, a flag set when any key matches; or a
    #: :class:`~diffpipe_core.parts.file_variant.Shape`: a size of a tensor's shape (a width, a channel count; divided
    #: by a config value, as a head count from a width). E.g. Flux's ``{"num_layers":
    #: r"(?:^|\.)(?:double_blocks|transformer_blocks)\.(\d+)\.", "guidance_embeds": ...}``. A file's ``config``
    #: metadata (its diffusers config JSON) is read too, below the tensors.
    file_config: ClassVar[dict[str, Any]] = {}

    def config_from_file(self, model_config: ModelConfigBase, config: dict[str, Any]) -> dict[str, Any]:
        """The config values of the ``diffusion_model`` file that differ from ``config``: its ``config`` metadata,
        then what :attr:`file_config` reads from its tensors (only its header is read)."""
        return {k: v for k, (v, _) in self.file_variant(model_config, config).items()}

    def file_variant(self, model_config: ModelConfigBase, config: dict[str, Any]) -> dict[str, tuple[Any, str]]:
        """:meth:`config_from_file` with where each value was read: key -> ``(value, "tensors" or "metadata")``."""
        single = self.single_file(model_config) if self.single_file_key == "diffusion_model" else None
        if single is None or not Path(single).is_file():
            return {}
        from diffpipe_core.component_files import read_component_file
        from diffpipe_core.parts.file_variant import file_variant

        file = read_component_file(Path(single), "diffusion_model")
        component = self.model_component(model_config)
        return file_variant(file.tensors, file.metadata, self.file_config, config, component)

    def layout_for(self, model_config: ModelConfigBase) -> KeyTable:
        layout = self.original_layout(self.model_folder_config(model_config))
        if layout is None:
            raise ValueError(f"model {self.spec.name!r} has no original single-file layout")
        return layout

    # ------------------------------------------------------------------------------------------ other components
    def held_components(self, model_config: ModelConfigBase) -> tuple[str, ...]:
        """Pipeline components the diffusion model holds as submodules of those names and trains with it (SDXL's text
        encoders with ``train_text_encoders``); default none. Their parameters are named ``<component>.<name>``;
        they load per stage from their folders (or the single file, through :meth:`component_layout`), and their
        LoRA tensors export under their own pipeline prefix (:func:`~diffpipe_core.parts.export.split_components`)."""
        return ()

    def component_layout(self, model_config: ModelConfigBase, component: str) -> KeyTable | None:
        """The key table of another component (a VAE, a text encoder) in the single file; None: it has none there."""
        return None

    def load_component(self, model_config: ModelConfigBase, component: str, dtype: torch.dtype, device: Any) -> Any:
        """Another component, frozen, in eval mode, on ``device`` (a skeleton on ``meta``): from the single file through
        :meth:`component_layout` when it has one, else from the folder."""
        import torch

        folder, single = self.model_folder(model_config), self.single_file(model_config)
        if torch.device(device).type == "meta":
            return self.folder.skeleton(folder, component, dtype)
        layout = self.component_layout(model_config, component) if single is not None else None
        if layout is None:
            given = self.folder.component_files(folder, model_config).get(component)  # [model] vae, text_encoders
            return self.folder.load(folder, component, dtype, device, given)
        return self.folder.load_original(folder, component, Path(single), layout, dtype, device)  # type: ignore[arg-type]

    def original_components(self, model_config: ModelConfigBase, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The base model's ``names`` components in their original layout (copied from the single file, or converted
        from the folder through :meth:`component_layout`), for a single-file export of the whole pipeline."""
        from safetensors import safe_open

        layouts = {name: self.component_layout(model_config, name) for name in names}
        single = self.single_file(model_config)
        if single is None:
            folder = self.model_folder(model_config)
            return {k: v for n, t in layouts.items() if t for k, v in self.folder.original_state(folder, n, t).items()}
        prefixes = tuple(p for t in layouts.values() if t for p in t.read_prefixes)
        with safe_open(str(single), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefixes)}

    # ------------------------------------------------------------------------------------------ hooks
    @hookimpl
    def model_spec(self) -> ModelSpec:
        """The declared :attr:`spec`."""
        return self.spec

    def checked_folder(self, model_config: ModelConfigBase) -> DiffusersFolder:
        """The component table ``validate_model_files`` checks the folder against (default :attr:`folder`); a model
        whose folders may lack some components (Wan's second expert and image encoder) returns the table of the
        ones this folder's ``model_index.json`` lists."""
        return self.folder

    def sibling_problem(self, model_config: ModelConfigBase) -> str | None:
        """The single file is another model type's (:attr:`sibling_markers`): it is named, with the type to use
        (only its header is read). None otherwise."""
        from diffpipe_core.model_files import safetensors_keys

        single = self.single_file(model_config)
        keys, problem = safetensors_keys(single) if single is not None and self.sibling_markers else ([], "none")
        names = {k.split(".", n)[-1] for k in keys or () for n in (0, 1, 2)}  # with or without a file prefix
        for other, (what, markers) in ({} if problem else self.sibling_markers).items():
            if all(m in names for m in markers) and not all(m in names for m in self.single_file_markers):
                return (
                    f"{single}: this is a {what} checkpoint (it holds {markers[0]!r}), not a {self.spec.name!r} "
                    f'model; train it with [model] type = "{other}"'
                )
        return None

    @hookimpl
    def validate_model_files(self, model_config: ModelConfigBase) -> list[str]:
        """The folder's structure from :meth:`checked_folder`, and the single file's keys, without reading
        weights."""
        sibling = self.sibling_problem(model_config)
        if sibling:
            return [sibling]
        single = self.single_file(model_config)
        layout, checked = None, False
        folder, component = self.model_folder(model_config), self.model_component(model_config)
        if single is not None:
            try:
                layout = self.original_layout(self.model_folder_config(model_config))
                found = self.diffusion_model_file(model_config) if single.is_file() else None
            except (OSError, ValueError) as exc:
                return [str(exc)]
            fits = found is not None and found.fit is not None and found.fit.complete
            others = self.other_model_types(found.file.tensors) if found is not None and not fits else []
            if others:
                return [
                    f"{single}: a {' or '.join(map(repr, others))} checkpoint (it holds that model's keys), not a "
                    f"{self.spec.name!r} {component}; train it with [model] type = \"{others[0]}\""
                ]
            if found is not None and found.fit is not None:
                if not found.fit.complete:
                    return [
                        f"{single}: fills {found.fit.covered} of the {found.fit.total} tensors of the "
                        f"{self.spec.name} {component} that {folder / component / 'config.json'} describes (read as "
                        f"{found.fit.layout}; it lacks {', '.join(found.fit.missing)}): a file of another size or "
                        "variant of the model?"
                    ]
                checked = True  # its keys fit: diffusers' names are as good as the original layout's
            elif layout is None:
                layout = self.layout_for(model_config)
        folder_table = self.checked_folder(model_config)
        problems = folder_table.problems(folder, single, layout, self.single_file_markers, component, checked)
        if problems:
            return problems
        try:
            self.folder.component_files(folder, model_config)
        except (OSError, ValueError) as exc:
            return [str(exc)]
        unconditional = getattr(model_config, "unconditional_model", None)
        if unconditional is not None and self.spec.unconditional_model and self.single_file_key:
            # checked as a diffusion_model file is (its keys against the trained model's config)
            swapped = model_config.model_copy(update={self.single_file_key: unconditional, "unconditional_model": None})
            return [f"[model] unconditional_model: {line}" for line in self.validate_model_files(swapped)]
        return []

    def other_model_types(self, keys: Any) -> list[str]:
        """The installed model types whose original single files hold every key of their ``single_file_markers``
        among ``keys`` (with or without a file prefix), the most specific first; asked only of a file that does not
        fit this model, to name the type that trains it."""
        from diffpipe_core.registry import get_registry

        names = {k.split(".", n)[-1] for k in keys for n in (0, 1, 2)}
        if self.single_file_markers and all(m in names for m in self.single_file_markers):
            return []  # this model's own kind of file (of another size, say): not another type's
        found = []
        for info in get_registry().models():
            markers = getattr(info.module, "single_file_markers", ())
            if info.name != self.spec.name and markers and all(m in names for m in markers):
                found.append((len(markers), info.name))
        best = max((n for n, _ in found), default=0)
        return [name for n, name in found if n == best]

    def model_file_lines(self, model_config: ModelConfigBase) -> list[str]:
        """One line per component file (``diffpipe validate``): the layout found, dtype or quantization, parameter
        count and the component it gives; and where the configs come from."""
        from diffpipe_core.component_files import human_count

        folder = self.model_folder(model_config)
        lines = []
        if getattr(model_config, "path", None) is not None and "snapshots" in Path(folder).parts:
            lines.append(f"configs and tokenizers: {folder} (the Hugging Face cache)")
        single = self.single_file(model_config)
        if single is not None and self.single_file_key == "diffusion_model":
            found = self.diffusion_model_file(model_config)
            component = self.model_component(model_config)
            layout = found.fit.layout if found.fit else "unknown layout"
            kept = f", {len(found.plan)} linears kept quantized" if found.plan else ""
            config = self.folder.model_config(folder, component)
            read = self.file_variant(model_config, config)
            variant = "".join(
                f", {k} = {v} from the file's {source} "
                + (f"(the config says {config[k]})" if config.get(k) is not None else "(not in the config)")
                for k, (v, source) in read.items()
            )
            lines.append(
                f"diffusion_model: {single}: {layout}, {found.file.quantization()}{kept}, "
                f"{human_count(found.file.parameter_count())} parameters, sized by {folder / component / 'config.json'}"
                f"{variant}"
            )
        for component, (file, fit) in self.folder.component_files(folder, model_config).items():
            cls = self.folder.component_class(component)
            lines.append(
                f"{component}: {file.path}: {fit.layout}, {file.quantization()}, "
                f"{human_count(file.parameter_count())} parameters ({cls})"
            )
        return lines

    @hookimpl
    def load_encoders(self, model_config: ModelConfigBase, device: Any) -> Any:
        """The folder's :attr:`encoder_components`, frozen, on ``device``
        (:func:`~diffpipe_core.parts.encoders.load_components`)."""
        from diffpipe_core.parts.encoders import load_components

        return load_components(self.folder, model_config, device, *self.encoder_components)

    def build_skeleton(self, model_config: ModelConfigBase, device: Any, dtype: torch.dtype) -> nn.Module:
        """The diffusion model from its config, without weights, cast the way ``from_pretrained(torch_dtype=dtype)``
        casts (float32-kept modules stay float32).

        On ``meta`` it is built as ``from_pretrained`` builds it (:func:`~diffpipe_core.engine.model_loading.
        parameters_on_meta`): parameters on meta, to be filled from the weight files, and buffers and plain tensor
        attributes (RoPE tables) computed on the CPU, since no file holds them. Override it to check the config
        first (call ``super().build_skeleton``), or to build a model ``from_config`` cannot; whatever it builds,
        every tensor that is not in the weight files must be on a real device (the conformance kit names those
        left on meta)."""
        return self.skeleton_of(self.model_folder_config(model_config), device, dtype)

    def skeleton_of(self, config: dict[str, Any], device: Any, dtype: torch.dtype) -> nn.Module:
        """:attr:`model_class` built from ``config`` as :meth:`build_skeleton` builds it."""
        import torch

        from diffpipe_core.engine.model_loading import cast_skeleton, parameters_on_meta
        from diffpipe_core.parts.folder import find_class

        cls = find_class(self.model_class)
        if torch.device(device).type == "meta":
            with parameters_on_meta():
                model = cls.from_config(config)
        else:
            with torch.device(device):
                model = cls.from_config(config)
        return cast_skeleton(model, dtype)

    @hookimpl
    def load_diffusion_model(
        self, model_config: ModelConfigBase, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """On ``meta``, the skeleton (:meth:`build_skeleton`) whose weights :meth:`diffusion_model_weights` locates;
        otherwise the whole model with its weights, from the folder or converted from the single file. Missing,
        unexpected or misshapen tensors raise, naming the file and the keys."""
        import torch
        from safetensors import safe_open

        single = self.single_file(model_config)
        found = self.diffusion_model_file(model_config) if single is not None else None
        model = self.build_skeleton(model_config, "meta", dtype)
        if found is not None and found.plan:  # a quantized file: its linears stay quantized
            from diffpipe_core.component_files import keep_quantized

            keep_quantized(model, found.plan, dtype)
        if torch.device(device).type == "meta":
            return self._with_components(model, model_config, device, dtype)
        skeleton = model.state_dict()
        shapes = {k: tuple(v.shape) for k, v in skeleton.items()}
        if found is not None and found.fit is not None and (found.fit.table is None or found.plan or found.gguf):
            from diffpipe_core.component_files import fill_whole

            fill_whole(model, single, self.diffusion_model_weights(model_config)[0][1], device)
            return self._with_components(model, model_config, device, dtype)
        if single is not None:
            sibling = self.sibling_problem(model_config)
            if sibling:
                raise KeyError(sibling)
            fit = found.fit if found is not None else None
            layout = fit.table if fit is not None and fit.table is not None else self.layout_for(model_config)
            with safe_open(str(single), framework="pt") as f:  # only the model's part of a file holding others too
                state = layout.to_model({k: f.get_tensor(k) for k in layout.own_keys(f.keys())}, str(single), shapes)
        else:
            state = self.folder_state(model_config, self.model_component(model_config), shapes)
        model.load_state_dict({k: v.to(device, skeleton[k].dtype) for k, v in state.items()}, assign=True)
        return self._with_components(model, model_config, device, dtype)

    def folder_state(
        self, model_config: ModelConfigBase, component: str, shapes: dict[str, tuple[int, ...]]
    ) -> dict[str, torch.Tensor]:
        """The weights of the folder's ``component``, checked against the model's ``shapes`` (KeyError naming the
        missing and unexpected keys, ValueError a misshapen tensor)."""
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in self.folder.weight_files(self.model_folder(model_config), component):
            state.update(load_file(str(file)))
        folder = self.model_folder(model_config) / component
        missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
        if missing or unexpected:
            raise KeyError(
                f"{folder}: weights do not fit its config: {len(missing)} missing (e.g. {missing[:3]}), "
                f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"
            )
        for key, value in state.items():
            if tuple(value.shape) != shapes[key]:
                raise ValueError(f"{folder}: {key!r} has shape {tuple(value.shape)}, the config needs {shapes[key]}")
        return state

    @hookimpl
    def load_unconditional_model(
        self, model_config: ModelConfigBase, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """The spec's ``unconditional_model``: from the file ``[model] unconditional_model`` names (read as a
        ``diffusion_model`` file is: any layout it may be in, kept quantized; sized by the trained model's config and
        the file's tensors), else the folder's component of that name (its own config). On ``meta``, the
        skeleton."""
        import torch

        component = self.spec.unconditional_model
        if component is None:
            raise ValueError(f"model type {self.spec.name!r} declares no unconditional model")
        file = getattr(model_config, "unconditional_model", None)
        if file is not None:
            return self.load_diffusion_model(model_config.model_copy(update={self.single_file_key: file}), device,
                                             dtype)
        try:
            config = self.folder.model_config(self.model_folder(model_config), component)
            model = self.skeleton_of(config, "meta", dtype)
            skeleton = model.state_dict()
            if torch.device(device).type == "meta":
                return model
            state = self.folder_state(model_config, component, {k: tuple(v.shape) for k, v in skeleton.items()})
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{exc}; [sample] cfg > 1 runs the {component}: set [model] unconditional_model to its file"
            ) from None
        model.load_state_dict({k: v.to(device, skeleton[k].dtype) for k, v in state.items()}, assign=True)
        return model

    def _with_components(self, model: nn.Module, model_config: ModelConfigBase, device: Any, dtype: Any) -> nn.Module:
        for name in self.held_components(model_config):
            model.add_module(name, self.load_component(model_config, name, dtype, device))
        return model

    @hookimpl
    def diffusion_model_weights(self, model_config: ModelConfigBase) -> list[tuple[Path, Callable[[str], Any]]]:
        """Per-stage loading from the folder's weight files (keys are the model's own) or from the single file
        through :meth:`original_layout`'s key map (a fused tensor is cut only for a stage that holds its block)."""
        single, folder = self.single_file(model_config), self.model_folder(model_config)
        held = self.held_components(model_config)
        if single is None:
            files = self.folder.weight_files(folder, self.model_component(model_config))
            found = [(file, _same_key) for file in files]
            return found + [entry for name in held for entry in self.folder.component_weights(folder, name)]
        from diffpipe_core.model_files import safetensors_keys

        file = self.diffusion_model_file(model_config)
        if file.fit is not None:
            keys, key_map = list(file.file.tensors), file.key_map
        else:
            keys, problem = safetensors_keys(Path(single))
            if problem:
                raise FileNotFoundError(problem)
            key_map = self.layout_for(model_config).key_map(keys)
        found = [(Path(single), key_map)]
        for name in held:
            layout = self.component_layout(model_config, name)
            in_file = [(Path(single), layout.key_map(keys, name))] if layout else None
            found += in_file or self.folder.component_weights(folder, name)
        return found

    def diffusion_model_file(self, model_config: ModelConfigBase) -> DiffusionModelFile:
        """The ``diffusion_model`` file: its header, how its keys fit the model (diffusers' names under any prefix,
        or one of :meth:`original_layouts`), and which linears keep its quantized weights. Read once per file state."""
        from diffpipe_core.component_files import describe_diffusion_model

        single = Path(self.single_file(model_config))  # type: ignore[arg-type]
        stat = single.stat()
        key = (str(single), stat.st_mtime_ns, stat.st_size, str(self.model_folder(model_config)))
        cache = self.__dict__.setdefault("_diffusion_model_files", {})
        if key not in cache:
            import torch

            skeleton = self.build_skeleton(model_config, "meta", torch.float32)
            tables = self.original_layouts(self.model_folder_config(model_config))
            cache[key] = describe_diffusion_model(single, skeleton, tables)
        return cache[key]

    @hookimpl
    def lora_targets(self, model_config: ModelConfigBase) -> list[str]:
        """:meth:`default_lora_targets`."""
        return self.default_lora_targets(model_config)

    @hookimpl
    def original_weight_targets(self, model_config: ModelConfigBase, keys: list[str]) -> dict[str, list] | None:
        """The model tensors each original-layout key makes, by the first of :meth:`original_layouts` that knows
        it (:meth:`~diffpipe_core.parts.layout.KeyTable.targets`); None without :attr:`key_tables`."""
        tables = self.original_layouts(self.model_folder_config(model_config)) if self.key_tables else []
        if not tables:
            return None
        found = {}
        for key in keys:
            made = next((m for t in tables if (m := t.targets(t.strip(key)))), None)
            if made:
                found[key] = made
        return found

    @hookimpl
    def adapter_key_prefix(self) -> str:
        """The diffusion model's component name in its pipeline (``transformer``, ``unet``)."""
        return self.folder.model

    @hookimpl
    def export_adapter(self, state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str) -> Any:
        """``diffusers`` (peft keys under the pipeline prefix; alpha travels in the file's metadata, which the core
        writes, not as ``.alpha`` tensors) and, for a model with an original layout,
        ``comfyui`` (native module names under ``diffusion_model.``, fused where the native model fuses, with
        ``.alpha``). The layout is sized from the exported LoRA itself, so no model files are read."""
        from diffpipe_core.parts.export import export_lora, split_components

        if format == "diffusers":  # held components (trained text encoders) under their own pipeline prefix
            parts = split_components(state_dict, self.folder.model, tuple(self.folder.components))
            return {f"{part}.{k}": v for part, state in parts.items() for k, v in state.items()}
        layout = self.lora_layout(state_dict) if format == "comfyui" else None
        return export_lora(state_dict, alpha, format, self.folder.model, layout)

    def lora_layout(self, state_dict: dict[str, torch.Tensor]) -> KeyTable | None:
        """The original layout for a ComfyUI export of adapter modules (``state_dict``: a peft LoRA state dict, whose
        shapes size fused modules); None (the default without :attr:`key_tables`): the model has no ComfyUI
        format."""
        return import_module(self.key_tables).lora_layout(state_dict) if self.key_tables else None

    #: ComfyUI's key map for this model also takes diffusers module names under the pipeline prefix (and places
    #: them in fused weights itself), as for Flux; LoKr/LoHa, which cannot be fused, are saved under those names.
    comfy_takes_diffusers_names: ClassVar[bool] = False

    @hookimpl
    def adapter_key_names(self, modules: list[str], format: str) -> dict[str, str] | None:
        """Key stems of a LoKr/LoHa in ``comfyui``: each module's ComfyUI name under ``diffusion_model.`` from
        :meth:`lora_layout` (or its diffusers name under the pipeline prefix, with
        :attr:`comfy_takes_diffusers_names`); a module only a fused ComfyUI weight holds, or none at all, raises a
        ValueError naming it. Other formats: None."""
        import torch

        if format != "comfyui":
            return None
        layout = self.lora_layout({f"{m}.lora_A.weight": torch.empty(0, 0) for m in modules})
        if layout is None:
            return None
        stems: dict[str, str] = {}
        for target in layout.lora_targets(modules):
            present = [m for m in target.parts if m in modules]
            for module in present:
                if self.comfy_takes_diffusers_names:
                    stems[module] = f"{self.folder.model}.{module}"
                elif len(target.parts) == 1:
                    stems[module] = f"diffusion_model.{target.name}"
        missing = [m for m in modules if m not in stems]
        if missing:
            raise ValueError(
                f"modules with no ComfyUI counterpart of their own (a LoKr/LoHa cannot be fused): {missing[:3]}"
            )
        return stems

    @hookimpl
    def export_model(self, saved_dir: Path, model_config: ModelConfigBase, out_dir: Path, format: str) -> bool | None:
        """``diffusers`` (a model folder: the config and the saved shards) or, for a model with an original layout,
        ``single_file`` (one safetensors file in that layout, :attr:`single_file_name`)."""
        from diffpipe_core.parts.export import export_diffusers_folder, export_single_file

        folder = self.model_folder(model_config) / self.model_component(model_config)
        if format == "diffusers":  # the config of the model trained: the folder's, as the diffusion_model file reads
            config = {**json.loads((folder / "config.json").read_text()), **self.model_folder_config(model_config)}
            export_diffusers_folder(saved_dir, config, out_dir)
            return True
        if format == "single_file" and self.original_layout(self.model_folder_config(model_config)) is not None:
            export_single_file(saved_dir, self.layout_for(model_config), Path(out_dir) / self.single_file_name)
            return True
        return None

    @hookimpl
    def compute_loss(
        self,
        outputs: tuple[torch.Tensor, ...],
        targets: tuple[torch.Tensor, ...],
        context: TrainingContext,
    ) -> torch.Tensor:
        """The run's loss (squared error, or run.toml's ``pseudo_huber_c``/``huber_delta``/``smooth_l1_beta``) of
        the prediction to ``targets[0]``, weighted by ``targets[1]`` (a mask or weights) when present."""
        from diffpipe_core.parts.flow import flow_loss

        return flow_loss(outputs, targets, context)


def _same_key(key: str) -> str:
    return key
