"""One picture per sampling point: the samples (a video's first frame) in a grid, each prompt written under its
image, so a run's progress reads as one image per step (Pillow only)."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

PAD = 8
"""Pixels around and between the cells."""
MAX_CELL = 512
"""A sample larger than this on its long side is scaled down to it in the sheet (the sample files keep their size)."""
MIN_CELL = 192
"""A sample smaller than this on its long side is enlarged by a whole factor (nearest pixel) to at least it, so its
prompt has room."""
CAPTION_LINES = 3
FONT_SIZE = 14


@dataclass(frozen=True)
class SheetLayout:
    """Where everything goes: ``columns x rows`` cells of ``cell`` (width, height) pixels, each with
    ``caption_height`` pixels of text under it."""

    columns: int
    rows: int
    cell: tuple[int, int]
    caption_height: int

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` of the whole sheet."""
        w, h = self.cell
        return self.columns * (w + PAD) + PAD, self.rows * (h + self.caption_height + PAD) + PAD

    def origin(self, index: int) -> tuple[int, int]:
        """Top-left ``(x, y)`` of cell ``index`` (row-major)."""
        row, col = divmod(index, self.columns)
        w, h = self.cell
        return PAD + col * (w + PAD), PAD + row * (h + self.caption_height + PAD)


@lru_cache(maxsize=1)
def _font() -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=FONT_SIZE)  # a scalable font where Pillow has FreeType
    except (TypeError, OSError, ImportError):
        return ImageFont.load_default()


def _line_height() -> int:
    top, bottom = _font().getbbox("Ag")[1::2]
    return int(bottom - top) + 4


def sheet_layout(count: int, cell: tuple[int, int]) -> SheetLayout:
    """The grid for ``count`` samples of ``cell`` (width, height) pixels each (already scaled to the sheet):
    ``ceil(sqrt(count))`` columns, as many rows as needed."""
    if count < 1:
        raise ValueError("a contact sheet needs at least one sample")
    columns = math.ceil(math.sqrt(count))
    return SheetLayout(columns, math.ceil(count / columns), cell, CAPTION_LINES * _line_height() + PAD // 2)


def cell_size(width: int, height: int) -> tuple[int, int]:
    """A ``width x height`` sample's size in the sheet: scaled down so its long side is :data:`MAX_CELL`, enlarged
    by the smallest whole factor that reaches :data:`MIN_CELL`, or as is."""
    long = max(width, height)
    if long > MAX_CELL:
        scale = MAX_CELL / long
        return max(1, round(width * scale)), max(1, round(height * scale))
    factor = max(1, math.ceil(MIN_CELL / long))
    return width * factor, height * factor


def _caption_lines(text: str, width: int) -> list[str]:
    font = _font()
    per_line = max(4, int(width / max(1.0, font.getlength("x"))))
    while True:  # wrap by an estimate, then narrow until every line fits
        lines = textwrap.wrap(text, per_line, break_long_words=True) or [""]
        if per_line <= 4 or all(font.getlength(line) <= width for line in lines):
            break
        per_line -= 1
    if len(lines) > CAPTION_LINES:
        last = lines[CAPTION_LINES - 1]
        while last and font.getlength(last + "...") > width:
            last = last[:-1]
        lines = [*lines[: CAPTION_LINES - 1], last + "..."]
    return lines


def contact_sheet(images: list[np.ndarray], captions: list[str]) -> np.ndarray:
    """The grid of ``images`` (uint8 ``(H, W, 3)``, one per sample, all of one size) with ``captions[i]`` under
    image ``i``, on white; see :func:`sheet_layout` for where each goes. Returns uint8 ``(H, W, 3)``."""
    from PIL import Image, ImageDraw

    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    if not images:
        raise ValueError("a contact sheet needs at least one sample")
    height, width = images[0].shape[:2]
    cell = cell_size(width, height)
    layout = sheet_layout(len(images), cell)
    sheet = Image.new("RGB", layout.size, "white")
    draw = ImageDraw.Draw(sheet)
    line_height = _line_height()
    for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
        if image.shape[:2] != (height, width):
            raise ValueError(f"sample {i} is {image.shape[1]}x{image.shape[0]}; the others are {width}x{height}")
        tile = Image.fromarray(np.ascontiguousarray(image))
        if tile.size != cell:
            enlarged = cell[0] > width
            tile = tile.resize(cell, Image.Resampling.NEAREST if enlarged else Image.Resampling.LANCZOS)
        x, y = layout.origin(i)
        sheet.paste(tile, (x, y))
        for k, line in enumerate(_caption_lines(caption, cell[0])):
            draw.text((x, y + cell[1] + PAD // 2 + k * line_height), line, fill="black", font=_font())
    return np.asarray(sheet)
