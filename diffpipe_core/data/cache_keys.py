"""Content keys of cache entries: what a cached tensor depends on, hashed.

A media entry depends on the media content, its bucket and clip, the mask content, and the encoder
(plugin name, version and the ``[model]`` keys the plugin declares in ``spec.encoder_settings``); a
caption entry on the caption text and the same encoder fingerprint. Equal key = same tensors, so a
changed input can never be served from an old entry.

Encoder settings that are paths (a model folder, a VAE file) are keyed by what the files are, not by the
path string (:func:`encoder_identity`): replacing a model folder in place changes the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from diffpipe_core.data import archives
from diffpipe_core.data.items import ControlImage, MediaItem, PairedFile
from diffpipe_core.types import AudioSpec, ModelConfigBase

KEY_FORMAT = 2  # bump when the cached layout or key recipe changes


def _digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _setting_value(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value.expanduser().resolve())
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


# Parts of a model folder that hold the diffusion model itself (diffusers' component names), not an
# encoder: they do not change the cached latents or text embeddings, so they are left out of the identity.
DENOISER_PARTS = frozenset({"transformer", "transformer_2", "unet"})
# Small files (configs, tokenizers) are keyed by their content; weights by size, mtime and header.
CONTENT_KEYED_SUFFIXES = frozenset({".json", ".txt", ".yaml", ".yml", ".model"})
SMALL_FILE_BYTES = 1 << 20


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _safetensors_header_digest(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        header = f.read(min(size, 100 << 20))
    return hashlib.sha256(head + header).hexdigest()[:32]


def encoder_file_identity(path: Path, strict: bool) -> str:
    """What one encoder file is: its SHA-256 with ``strict``; else the content hash of a config-sized file,
    or ``size:mtime_ns`` plus the safetensors header's hash for weights."""
    if strict:
        return "sha256:" + _sha256_file(path)
    st = path.stat()
    if path.suffix.lower() in CONTENT_KEYED_SUFFIXES or st.st_size <= SMALL_FILE_BYTES:
        return "sha256:" + _sha256_file(path)
    ident = f"{st.st_size}:{st.st_mtime_ns}"
    if path.suffix.lower() == ".safetensors":
        ident += ":header:" + _safetensors_header_digest(path)
    return ident


def encoder_path_identity(path: Path, strict: bool = False) -> dict[str, str] | str:
    """The identity of a path-valued encoder setting: ``{relative file: identity}`` for a folder (hidden files
    and the denoiser's parts, see ``DENOISER_PARTS``, left out), one identity for a file, ``"missing"``."""
    path = Path(path).expanduser()
    if path.is_file():
        return encoder_file_identity(path, strict)
    if not path.is_dir():
        return "missing"
    out: dict[str, str] = {}
    for folder, dirs, files in os.walk(path):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (here == path and d in DENOISER_PARTS))
        for name in sorted(files):
            file = here / name
            if name.startswith(".") or (here == path and file.stem in DENOISER_PARTS):
                continue
            out[file.relative_to(path).as_posix()] = encoder_file_identity(file, strict)
    return out


def encoder_identity(model_config: ModelConfigBase, encoder_settings: tuple[str, ...],
                     strict: bool = False) -> dict[str, Any]:
    """What the encoders are, for the cache key: each ``encoder_settings`` value, with every path-valued one
    (a model folder or file) replaced by the identity of its files (:func:`encoder_path_identity`).

    Cheap without ``strict`` (a stat per file, the safetensors headers, the small config/tokenizer files'
    content), so it can run on every start; ``strict`` hashes every file.
    """
    settings: dict[str, Any] = {}
    for name in encoder_settings:
        if not hasattr(model_config, name):
            raise ValueError(
                f"spec.encoder_settings names {name!r}, but the [model] config has no such key "
                f"(keys: {', '.join(sorted(type(model_config).model_fields))})"
            )
        value = getattr(model_config, name)
        settings[name] = _setting_value(value)
        if isinstance(value, Path):
            files = encoder_path_identity(value, strict)
            # Keyed by content, not location: a moved folder is the same encoder (a missing one keeps its path).
            settings[name] = {"files": files} if files != "missing" else {"missing": settings[name]}
    return settings


def encoder_fingerprint(plugin_name: str, plugin_version: str, model_config: ModelConfigBase,
                        encoder_settings: tuple[str, ...], strict: bool = False) -> str:
    """Hash of everything about the encoders that changes their outputs: the plugin's name and version,
    :func:`encoder_identity` (which reads the encoder files' stats and headers, or hashes them with ``strict``) and
    ``[model] encoder_quantize`` when set."""
    try:
        settings = encoder_identity(model_config, encoder_settings, strict)
    except ValueError as exc:
        raise ValueError(f"model plugin {plugin_name!r}: {exc}") from None
    quantize = getattr(model_config, "encoder_quantize", None)  # every plugin's; keyed only when set (older keys hold)
    if quantize is not None:
        settings["encoder_quantize"] = quantize
    return _digest({"format": KEY_FORMAT, "plugin": plugin_name, "version": plugin_version, "settings": settings})


def file_content_key(path: Path, strict: bool, size_mtime: tuple[int, int] | None = None) -> str:
    """``size:mtime_ns`` of a file, or its SHA-256 when ``strict``. ``size_mtime`` is a ``stat`` the caller
    already made (the scan index), so the file is not stat'ed twice."""
    if size_mtime is not None and not strict:
        return f"{size_mtime[0]}:{size_mtime[1]}"
    if strict:
        h = hashlib.sha256()
        source = archives.open_media(path)
        with open(source, "rb") if isinstance(source, str) else source as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return "sha256:" + h.hexdigest()
    st = archives.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def mask_content_key(item: MediaItem, use_masks: bool, strict: bool) -> str:
    """What the mask fed to the encoder depends on: none at all, an all-ones mask, or a file's content."""
    if not use_masks:
        return "none"
    if item.mask_path is None:
        return "ones"
    return "file:" + file_content_key(item.mask_path, strict)


def media_key(item: MediaItem, mask_key: str, fingerprint: str, first_frame: bool = False,
              audio: AudioSpec | None = None) -> str:
    """Cache key of one item's media tensors (latents and anything else derived from the pixels). ``first_frame``:
    the model is handed each clip's first frame too (``ModelSpec.first_frame``), so its outputs depend on that.
    ``audio``: the model's :class:`~diffpipe_core.types.AudioSpec`; its audio latents are cached with the clip's, so
    the key holds the spec (the sound itself is in the file's content key, as the frames are)."""
    b = item.bucket
    # The path is part of the key: two files may share size and mtime (the non-strict content key).
    payload = ["media", fingerprint, str(item.path), item.content_key, [b.width, b.height, b.frames],
               item.clip_start, mask_key]
    if first_frame:  # appended only when set: the keys of every other model stay as they were
        payload.append("first_frame")
    if audio is not None:
        payload.append(["audio", audio.sample_rate, audio.channels, audio.damaged])
    if item.paired:  # files encoded with the item (a last frame): their content (appended only then)
        payload.append(paired_payload(item.paired))
    return _digest(payload)


def paired_payload(files: tuple[PairedFile, ...]) -> list[Any]:
    """What an item's (or control's) paired files add to its cache key: each file's role, path and content key."""
    return ["paired", *([f.role, str(f.path), f.content_key] for f in files)]


def control_key(control: ControlImage, index: int, fingerprint: str) -> str:
    """Cache key of the tensors of one control image, encoded as control number ``index`` at its bucket's size."""
    b = control.bucket
    payload = ["control", fingerprint, str(control.path), control.content_key, [b.width, b.height], index]
    if control.clip_start is not None:  # a control video's clip (appended only then: image keys stay as they were)
        payload.append([b.frames, control.clip_start])
    if control.paired:  # a control mask, reference images: encoded with the control (appended only then)
        payload.append(paired_payload(control.paired))
    return _digest(payload)


def caption_key(text: str, fingerprint: str, controls: tuple[str, ...] = ()) -> str:
    """Cache key of one caption's text tensors; ``controls`` are the control keys of the images its encoding sees
    (``ModelSpec.control_in_captions``)."""
    return _digest(["caption", fingerprint, text, *([list(controls)] if controls else [])])
