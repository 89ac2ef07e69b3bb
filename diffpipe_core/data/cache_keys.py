"""Content keys of cache entries: what a cached tensor depends on, hashed.

A media entry depends on the media content, its bucket and clip, the mask content, and the encoder
(plugin name, version and the ``[model]`` keys the plugin declares in ``spec.encoder_settings``); a
caption entry on the caption text and the same encoder fingerprint. Equal key = same tensors, so a
changed input can never be served from an old entry.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from diffpipe_core.data.items import MediaItem
from diffpipe_core.types import ModelConfigBase

KEY_FORMAT = 1  # bump when the cached layout or key recipe changes


def _digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _setting_value(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value.expanduser().resolve())
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def encoder_fingerprint(plugin_name: str, plugin_version: str, model_config: ModelConfigBase,
                        encoder_settings: tuple[str, ...]) -> str:
    """Hash of everything about the encoders that changes their outputs."""
    settings = {}
    for name in encoder_settings:
        if not hasattr(model_config, name):
            raise ValueError(
                f"model plugin {plugin_name!r} lists {name!r} in spec.encoder_settings, but its [model] "
                f"config has no such key (keys: {', '.join(sorted(type(model_config).model_fields))})"
            )
        settings[name] = _setting_value(getattr(model_config, name))
    return _digest({"format": KEY_FORMAT, "plugin": plugin_name, "version": plugin_version, "settings": settings})


def file_content_key(path: Path, strict: bool) -> str:
    """``size:mtime_ns`` of a file, or its SHA-256 when ``strict``."""
    if strict:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return "sha256:" + h.hexdigest()
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def mask_content_key(item: MediaItem, use_masks: bool, strict: bool) -> str:
    """What the mask fed to the encoder depends on: none at all, an all-ones mask, or a file's content."""
    if not use_masks:
        return "none"
    if item.mask_path is None:
        return "ones"
    return "file:" + file_content_key(item.mask_path, strict)


def media_key(item: MediaItem, mask_key: str, fingerprint: str) -> str:
    """Cache key of one item's media tensors (latents and anything else derived from the pixels)."""
    b = item.bucket
    # The path is part of the key: two files may share size and mtime (the non-strict content key).
    return _digest(
        ["media", fingerprint, str(item.path), item.content_key, [b.width, b.height, b.frames], item.clip_start,
         mask_key]
    )


def caption_key(text: str, fingerprint: str) -> str:
    """Cache key of one caption's text tensors."""
    return _digest(["caption", fingerprint, text])
