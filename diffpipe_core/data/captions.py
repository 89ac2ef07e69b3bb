"""Reading caption files: UTF-8, or UTF-8/16/32 with a byte-order mark; anything else is refused.

Its own module so that the scan (:mod:`diffpipe_core.data.scan`) and the scan index
(:mod:`diffpipe_core.data.scan_index`), which the scan uses, both read captions without importing each other.
"""

from __future__ import annotations

import codecs
from pathlib import Path

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def read_caption(path: Path) -> str:
    """A caption file's text: UTF-8, or UTF-8/16/32 with a byte-order mark. Other encodings raise
    ``ValueError`` saying where the first bad byte is, rather than guessing and training on mojibake."""
    return decode_caption(path.read_bytes(), path.name)


def decode_caption(data: bytes, name: str) -> str:
    """The text of caption bytes (of the file called ``name``, for the message), as :func:`read_caption`."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding).strip()
            except UnicodeDecodeError:
                break
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"caption file {name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None
