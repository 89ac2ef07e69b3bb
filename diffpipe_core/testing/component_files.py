"""Test helpers for model files as users have them: a tiny diffusers folder rewritten as ComfyUI component files
(transformer, VAE and text encoders, each one file in ComfyUI's layout), a folder of only its configs and tokenizers,
and ComfyUI's quantized files (fp8 scaled, the older and the current format, int8 and NVFP4).

    folder = write_tiny_flux(tmp / "model")
    files = write_component_files(folder, tmp / "comfy", transformer_table=layout_for_config(config))
    config_only(folder, tmp / "configs")
    fp8 = quantize_file(files["diffusion_model"], tmp / "fp8.safetensors", "fp8_scaled")
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core.parts.layout import KeyTable

CONVROT_GROUP = 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json")
COMFY_PREFIX = "model.diffusion_model."


def config_only(folder: Path, out: Path) -> Path:
    """A copy of diffusers folder ``folder`` at ``out`` without any weight file: configs, tokenizers, the scheduler and
    ``model_index.json`` (what a user keeps beside ComfyUI files, or the Hugging Face cache holds without weights)."""
    out = Path(out)
    for file in Path(folder).rglob("*"):
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES):
            target = out / file.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)
    return out


def hub_snapshot(folder: Path, cache: Path, repo: str) -> Path:
    """``folder``'s configs and tokenizers as the Hugging Face cache keeps a snapshot of ``repo`` (``cache`` is the
    ``HF_HUB_CACHE`` folder); returns the snapshot."""
    root = Path(cache) / f"models--{repo.replace('/', '--')}"
    snapshot = config_only(folder, root / "snapshots" / "0123abcd")
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text("0123abcd")
    return snapshot


def component_state(folder: Path, component: str) -> dict[str, torch.Tensor]:
    """The weights of one component folder as saved (diffusers' or transformers' names)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted((Path(folder) / component).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def save(state: Mapping[str, torch.Tensor], file: Path, metadata: Mapping[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(file), metadata=dict(metadata or {"format": "pt"}))
    return file


def write_component_files(
    folder: Path,
    out: Path,
    transformer_table: KeyTable | None = None,
    vae_table: KeyTable | None = None,
    text_prefixes: Mapping[str, str] | None = None,
    model: str = "transformer",
    text_components: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Every component of diffusers folder ``folder`` as one ComfyUI-style file under ``out``:
    ``diffusion_model`` (``transformer_table``'s original layout under ``model.diffusion_model.``, or diffusers' names
    under it), ``vae`` (``vae_table``'s layout, or diffusers' names) and each ``text_encoder*`` and
    ``text_components`` component (transformers' names, under ``text_prefixes[name]`` when given). Returns
    ``{"diffusion_model": path, "vae": path, "text_encoders": [paths]}`` in the folder's order."""
    out = Path(out)
    state = component_state(folder, model)
    state = transformer_table.to_original(state) if transformer_table is not None else state
    files: dict[str, Any] = {"diffusion_model": save({COMFY_PREFIX + k: v for k, v in state.items()}, out / "dit.st")}
    if (Path(folder) / "vae").is_dir():
        vae = component_state(folder, "vae")
        files["vae"] = save(vae_table.to_original(vae) if vae_table is not None else vae, out / "vae.st")
    from diffpipe_core.model_files import pipeline_index

    index = json.loads(pipeline_index(Path(folder)).read_text())
    names = sorted(n for n in index if (n.startswith("text_encoder") or n in text_components)
                   and (Path(folder) / n / "config.json").is_file())
    files["text_encoders"] = []
    for name in names:
        prefix = (text_prefixes or {}).get(name, "")
        state = {prefix + k: v for k, v in component_state(folder, name).items()}
        files["text_encoders"].append(save(state, out / f"{name}.st"))
    return files


def quantize_state(
    state: Mapping[str, torch.Tensor], form: str, min_elements: int = 256, keep: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """``state`` with every 2-D ``.weight`` of at least ``min_elements`` (and whose key holds none of ``keep``: those
    stay as they are, as in ComfyUI's "mixed" files) quantized as ComfyUI stores it:

    - ``"fp8_scaled"``: float8_e4m3fn with a float32 ``scale_weight`` each and the ``scaled_fp8`` marker (the older
      files);
    - ``"comfy_quant_fp8"``: float8_e4m3fn with ``weight_scale`` and the layer's ``comfy_quant`` JSON (current files);
    - ``"int8"``: int8 with one ``weight_scale`` per output row and ``comfy_quant`` ``int8_tensorwise``;
    - ``"int8_convrot"``: the same of the weight rotated in Hadamard groups of :data:`CONVROT_GROUP` inputs (ComfyUI's
      "convrot" files use 256; the tiny models' inputs divide into 16);
    - ``"fp8"``: plain float8_e4m3fn casts, no scale;
    - ``"nvfp4"``: :func:`nvfp4_quantize`'s packed FP4 ``weight``, blocked ``weight_scale`` and ``weight_scale_2``
      with ``comfy_quant`` ``nvfp4``.
    """
    import torch

    from diffpipe_core.quantized_files import rotate

    out: dict[str, torch.Tensor] = {}
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for key, value in state.items():
        if not (key.endswith(".weight") and value.dim() == 2 and value.numel() >= min_elements) or any(
            part in key for part in keep
        ):
            out[key] = value
            continue
        module, w = key[: -len(".weight")], value.float()
        if form == "fp8":
            out[key] = w.to(torch.float8_e4m3fn)
        elif form in ("fp8_scaled", "comfy_quant_fp8"):
            scale = w.abs().amax().clamp(min=1e-12) / fp8_max
            out[key] = (w / scale).to(torch.float8_e4m3fn)
            out[f"{module}.{'scale_weight' if form == 'fp8_scaled' else 'weight_scale'}"] = scale.reshape(())
            if form == "comfy_quant_fp8":
                out[f"{module}.comfy_quant"] = _layer_json({"format": "float8_e4m3fn"})
        elif form in ("int8", "int8_convrot"):
            conf: dict[str, Any] = {"format": "int8_tensorwise"}
            if form == "int8_convrot":  # stored rotated in Hadamard groups of CONVROT_GROUP inputs
                w = rotate(w, CONVROT_GROUP)
                conf |= {"convrot": True, "convrot_groupsize": CONVROT_GROUP}
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            out[key] = (w / scale).round().clamp(-127, 127).to(torch.int8)
            out[f"{module}.weight_scale"] = scale
            out[f"{module}.comfy_quant"] = _layer_json(conf)
        elif form == "nvfp4":
            packed, block_scales, scale_2, _ = nvfp4_quantize(w)
            out[key], out[f"{module}.weight_scale"], out[f"{module}.weight_scale_2"] = packed, block_scales, scale_2
            out[f"{module}.comfy_quant"] = _layer_json({"format": "nvfp4"})
        else:
            raise ValueError(f"unknown form {form!r}")
    if form == "fp8_scaled":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 code (sign bit 8, magnitude index 0-7) nearest each of ``x`` (within +-6), ties to the even code, as
    comfy-kitchen's ``_f32_to_floatx_unpacked`` rounds."""
    import torch

    grid = torch.tensor(E2M1_VALUES)
    mids = (grid[1:] + grid[:-1]) / 2
    a = x.abs().clamp(max=6.0)
    index = torch.bucketize(a, mids)  # a tie goes to the smaller value ...
    tie = (index < len(mids)) & (a == mids[index.clamp(max=len(mids) - 1)]) & (index % 2 == 1)
    index = index + tie.long()  # ... unless its code is odd: then to the even one above
    return (index | torch.where(x < 0, 8, 0)).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    import torch

    magnitudes = torch.tensor(E2M1_VALUES)[(codes & 7).long()]
    return torch.where(codes & 8 != 0, -magnitudes, magnitudes)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[rows, blocks]`` scales in cuBLAS's blocked order (``to_blocked``), as a ``[roundup(rows, 128),
    roundup(blocks, 4)]`` tensor: zero-padded tiles of 128 x 4, row-major, the scale of (row r, block c) at
    ``(r % 32) * 16 + (r % 128 // 32) * 4 + c % 4`` of its tile. Written from the cuBLAS layout's formula (not the
    reader's permutation), so that the reader is checked against it."""
    import torch

    rows, blocks = scales.shape
    tile_cols = -(-blocks // 4)
    padded = (-(-rows // 128) * 128, tile_cols * 4)
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(blocks).unsqueeze(0)
    at = ((r // 128) * tile_cols + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    flat = torch.zeros(padded[0] * padded[1], dtype=scales.dtype)
    flat[at.reshape(-1)] = scales.reshape(-1)
    return flat.reshape(padded)


def nvfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` (2-D) as comfy-kitchen's ``quantize_nvfp4`` stores it: padded with zeros to multiples of 16; the tensor
    scale ``amax / (6 * 448)``; per block of 16 inputs the float8_e4m3fn scale ``block amax / 6 / tensor scale``;
    values ``w / (tensor scale * block scale)`` rounded to E2M1 and packed two a byte, the first in the high nibble.
    Returns ``(packed uint8, blocked scales float8, tensor scale float32, the values it stands for)`` (values in
    ``w``'s shape, float32: the writer's own dequantization, before any packing or swizzling)."""
    import torch

    rows, cols = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -cols % 16, 0, -rows % 16))
    amax = padded.abs().amax()
    scale_2 = (amax / (6 * 448) if amax > 0 else torch.tensor(1.0)).to(torch.float32)
    blocks = padded.reshape(padded.shape[0], -1, 16)
    block_scales = (blocks.abs().amax(dim=-1) / 6 / scale_2).clamp(max=448).to(torch.float8_e4m3fn)
    total = scale_2 * block_scales.float()
    safe = torch.where(total == 0, torch.ones_like(total), total)
    codes = _e2m1_codes(torch.where(total.unsqueeze(-1) == 0, 0.0, blocks / safe.unsqueeze(-1)))
    values = _e2m1_values(codes) * total.unsqueeze(-1)
    codes = codes.reshape(padded.shape)
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    return packed, swizzle_scales(block_scales), scale_2.reshape(()), values.reshape(padded.shape)[:rows, :cols]


def _nvfp4_values(packed: torch.Tensor, blocked: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """A stored NVFP4 weight's (16-padded) values, read back through :func:`swizzle_scales`' formula."""
    import torch

    rows, half = packed.shape
    codes = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(rows, 2 * half)
    count = rows * half // 8
    scales = torch.empty(count, dtype=torch.float32)
    flat = blocked.view(torch.float8_e4m3fn).reshape(-1).float()
    ids = swizzle_scales(torch.arange(1, count + 1).reshape(rows, half // 8)).reshape(-1)  # 1 + the scale's index
    scales[ids[ids > 0] - 1] = flat[ids > 0]
    total = scale_2.float().reshape(()) * scales.reshape(rows, half // 8)
    return (_e2m1_values(codes).reshape(rows, -1, 16) * total.unsqueeze(-1)).reshape(rows, 2 * half)


def _layer_json(conf: dict[str, Any]) -> torch.Tensor:
    import torch

    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def quantize_file(file: Path, out: Path, form: str, min_elements: int = 256, keep: tuple[str, ...] = ()) -> Path:
    """Component file ``file`` quantized as :func:`quantize_state` says, saved at ``out``."""
    from safetensors.torch import load_file

    return save(quantize_state(load_file(str(file)), form, min_elements, keep), Path(out))


def dequantized_state(file: Path) -> dict[str, torch.Tensor]:
    """A quantized component file's weights as float32 values (``stored * scale``, rotated back where stored rotated;
    NVFP4 decoded through :func:`swizzle_scales`' formula, in its 16-padded shape), markers and scales left out: what
    the quantized file stands for."""
    import torch
    from safetensors.torch import load_file

    from diffpipe_core.quantized_files import rotate

    state = load_file(str(file))
    out = {}
    for key, value in state.items():
        last = key.rpartition(".")[2]
        if key == "scaled_fp8" or last in ("comfy_quant", "scale_weight", "weight_scale", "weight_scale_2",
                                           "input_scale"):
            continue
        module = key.rpartition(".")[0]
        if last == "weight" and f"{module}.weight_scale_2" in state:  # NVFP4 (16-padded)
            out[key] = _nvfp4_values(value, state[f"{module}.weight_scale"], state[f"{module}.weight_scale_2"])
            continue
        scale = state.get(f"{module}.scale_weight", state.get(f"{module}.weight_scale"))
        value = value.to(torch.float32)
        out[key] = value * scale.float() if scale is not None and last == "weight" else value
        conf = state.get(f"{module}.comfy_quant")
        group = json.loads(conf.numpy().tobytes()).get("convrot_groupsize") if conf is not None else None
        if group and last == "weight":
            out[key] = rotate(out[key], group)
    return out


def assert_same_state(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Two loads of a model hold the same tensors, key for key, in the same dtypes (``torch.equal`` alone does not
    compare dtypes)."""
    import torch

    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))[:5]
    for key in got:
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key


def quantizable_linears(model: nn.Module, min_elements: int = 256) -> set[str]:
    """The names of ``model``'s linears whose weights :func:`quantize_state` quantizes (2-D, at least
    ``min_elements``) and that a quantized load keeps quantized: all but those in the model class's
    ``_keep_in_fp32_modules`` (they load dequantized, as Wan's time embedder)."""
    from torch import nn

    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return {
        n
        for n, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.numel() >= min_elements and not keep & set(n.split("."))
    }


def comfyui_files(
    folder: Path,
    out: Path,
    transformer_layout: Any = None,
    vae_layout: Any = None,
    text_prefixes: Mapping[str, str] | None = None,
    text_components: tuple[str, ...] = (),
) -> dict[str, Any]:
    """:func:`write_component_files` of diffusers folder ``folder`` with its key tables made from the folder's own
    configs (``transformer_layout(transformer/config.json)``, ``vae_layout(vae/config.json)``; None: diffusers'
    names), plus ``"configs"``: the folder without weights at ``out/configs`` (:func:`config_only`);
    ``text_components``: text encoders not named ``text_encoder*``."""
    folder = Path(folder)

    def table(layout: Any, component: str) -> KeyTable | None:
        return layout(json.loads((folder / component / "config.json").read_text())) if layout else None

    files = write_component_files(
        folder, out, table(transformer_layout, "transformer"), table(vae_layout, "vae"), text_prefixes,
        text_components=text_components,
    )
    files["configs"] = config_only(folder, Path(out) / "configs")
    return files


def files_config(schema: Any, model_type: str, files: Mapping[str, Any], text_encoder_type: str | None = None,
                 **keys: Any) -> Any:
    """``schema``'s ``[model]`` table of :func:`comfyui_files`' ``files`` (configs folder, diffusion model, VAE, text
    encoders: each ``{"path", "type": text_encoder_type}`` where given), encoders in float32, then ``keys``."""
    from diffpipe_core.schema import validate

    encoders = files["text_encoders"]
    if text_encoder_type is not None:
        encoders = [{"path": path, "type": text_encoder_type} for path in encoders]
    table = {"type": model_type, "path": files["configs"], "diffusion_model": files["diffusion_model"],
             "vae": files["vae"], "text_encoders": encoders, "encoder_dtype": "float32"}
    return validate(schema, {**table, **keys}, "test")


def assert_loads_as_the_folder(plugin: Any, files_config: Any, folder_config: Any, encoders: tuple[str, ...]) -> None:
    """``files_config`` (component files) validates, and its ``encoders`` and diffusion model (in float32 and
    bfloat16) load exactly as ``folder_config``'s: the same tensors in the same dtypes."""
    import torch

    cpu = torch.device("cpu")
    assert plugin.validate_model_files(files_config) == []
    got, expected = plugin.load_encoders(files_config, cpu), plugin.load_encoders(folder_config, cpu)
    for name in encoders:
        assert_same_state(getattr(got, name).state_dict(), getattr(expected, name).state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        loaded = plugin.load_diffusion_model(files_config, cpu, dtype).state_dict()
        assert_same_state(loaded, plugin.load_diffusion_model(folder_config, cpu, dtype).state_dict())


def assert_kept_quantized(plugin: Any, config: Any, plain_config: Any, storage: torch.dtype) -> nn.Module:
    """``config``'s quantized ``diffusion_model`` validates and loads with every linear :func:`quantizable_linears`
    names (those of the model ``plain_config``, its unquantized file, loads) kept quantized in ``storage``, says so in
    ``model_file_lines``, and loads per stage reading each stage's own tensors. Returns the loaded model."""
    import torch

    from diffpipe_core.quantize import ScaledLinear
    from diffpipe_core.registry import Registry
    from diffpipe_core.testing.stage_reads import assert_stages_read_their_own

    cpu = torch.device("cpu")
    assert plugin.validate_model_files(config) == []
    model = plugin.load_diffusion_model(config, cpu, torch.bfloat16)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    assert kept and set(kept) == quantizable_linears(plugin.load_diffusion_model(plain_config, cpu, torch.bfloat16))
    assert all(m.weight.dtype == storage for m in kept.values())
    assert f"{len(kept)} linears kept quantized" in plugin.model_file_lines(config)[0]
    registry = Registry()
    assert registry.register_model(plugin.spec.name, plugin).ok
    assert_stages_read_their_own(registry.model(plugin.spec.name), config)
    return model


def write_gguf(file: Path, out: Path, kind: str = "Q8_0") -> Path:
    """Safetensors component file ``file`` as a GGUF file at ``out`` (as city96's GGUF conversions: the same names),
    every 2-D ``.weight`` whose rows divide into ``kind``'s blocks quantized as ``kind`` (``Q8_0``, ``Q4_0``: those
    gguf-py quantizes), the rest float32."""
    import gguf
    from safetensors.torch import load_file

    qtype = gguf.GGMLQuantizationType[kind]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch="diffpipe-test")
    for key, value in load_file(str(file)).items():
        data = value.float().numpy()
        if key.endswith(".weight") and data.ndim == 2 and data.shape[1] % block == 0:
            writer.add_tensor(key, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(key, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_values(file: Path) -> dict[str, torch.Tensor]:
    """A GGUF file's tensors as float32 values (quantized ones dequantized): what the file stands for."""
    from diffpipe_core.weight_files import gguf_dequantize, gguf_header, open_weights

    header, _ = gguf_header(file)
    out = {}
    with open_weights(file) as f:
        for key, (kind, shape) in header.items():
            value = f.get_tensor(key)
            out[key] = value.float() if kind in ("F32", "F16", "BF16") else gguf_dequantize(value, kind).reshape(shape)
    return out


def variant_model(plugin: Any, folder: Path, seed: int = 1, **changes: Any) -> nn.Module:
    """``plugin``'s diffusion model of another variant than diffusers folder ``folder``'s: its config with
    ``changes`` (block counts, heads, flags), random weights from ``seed``."""
    import torch

    from diffpipe_core.parts.folder import find_class

    torch.manual_seed(seed)
    config = {**plugin.folder.model_config(Path(folder)), **changes}
    return find_class(plugin.model_class).from_config(config).eval()


def variant_file(plugin: Any, model: nn.Module, out: Path) -> Path:
    """Diffusion model ``model`` (of another variant than a folder's) as a ComfyUI ``diffusion_model`` file at ``out``:
    its weights in ``plugin``'s original layout (under the layout's own prefix, else ``model.diffusion_model.``), or in
    diffusers' names under ``model.diffusion_model.`` for a model without one."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    table = plugin.original_layout(dict(model.config))
    if table is not None and table.write_prefix:
        return save(table.to_original(state), Path(out))
    state = table.to_original(state) if table is not None else state
    return save({COMFY_PREFIX + k: v for k, v in state.items()}, Path(out))


def assert_variant_loads_as_itself(plugin: Any, config: Any, variant: nn.Module, read: Mapping[str, Any]) -> None:
    """``config``'s ``diffusion_model`` file holds ``variant`` (a model of another variant than ``config.path``'s
    folder): it validates, ``model_file_lines`` names each value of ``read`` (config key -> the variant's value) as read
    from the file, and the model builds with those values and loads the file's weights exactly (float32)."""
    import torch

    problems = plugin.validate_model_files(config)
    assert problems == [], problems
    line = plugin.model_file_lines(config)[0]
    for key, value in read.items():
        assert variant.config[key] == value, (key, variant.config[key])
        assert f"{key} = {value} from the file's tensors" in line, (key, line)
    model = plugin.load_diffusion_model(config, torch.device("cpu"), torch.float32)
    assert all(model.config[key] == value for key, value in read.items())
    assert_same_state(model.state_dict(), {k: v.float() for k, v in variant.state_dict().items()})


def model_keys(files: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys of :func:`comfyui_files`' files: ``path`` (the configs), ``diffusion_model``, ``vae`` and
    ``text_encoders``."""
    keys = {"path": str(files["configs"]), "diffusion_model": str(files["diffusion_model"])}
    if "vae" in files:
        keys["vae"] = str(files["vae"])
    keys["text_encoders"] = [str(p) for p in files["text_encoders"]]
    return keys


def train_from_files(root: Path, config: Path, keys: Mapping[str, Any], procs: int = 1, **env: str) -> Path:
    """Run ``config`` (a run.toml whose ``[model]`` says ``path = "model"``, maybe with a ``diffusion_model``) with
    the model given by ``keys`` instead (:func:`model_keys`), in ``procs`` processes. Returns its run folder."""
    import re

    from diffpipe_core.anchor.keys import toml_key, toml_value
    from diffpipe_core.testing import runs

    text = re.sub(r"^(?:diffusion_model|transformer_file) = .*\n", "", Path(config).read_text(), flags=re.M)
    given = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in keys.items())
    text, n = re.subn(r"^path = [\"']model[\"']\n", lambda _: given, text, flags=re.M)
    assert n == 1, f"{config}: its [model] names its folder as path = 'model'"
    Path(config).write_text(text)
    return runs.train(root, config, procs=procs, timeout=600, **env)


def assert_trains_as(run: Path, expected: Path) -> None:
    """Run ``run`` trained as ``expected`` did: the same losses (rel 1e-6) and LoRA files (every format both saved)."""
    import pytest
    import torch
    from safetensors.torch import load_file

    from diffpipe_core.testing import runs

    got, want = runs.losses(run), runs.losses(expected)
    assert len(got) == len(want) > 0 and got == pytest.approx(want, rel=1e-6, abs=1e-7)
    names = sorted(p.name for p in (expected / "saved/final").glob("adapter_model*.safetensors"))
    assert names and names == sorted(p.name for p in (run / "saved/final").glob("adapter_model*.safetensors"))
    for name in names:
        a, b = load_file(str(run / "saved/final" / name)), load_file(str(expected / "saved/final" / name))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), name
