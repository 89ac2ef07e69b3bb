"""Image decoding: cover-resize and center crop, every Pillow mode, EXIF orientation, masks, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffpipe_core.data.decode import MediaError, load_media, probe_image
from diffpipe_core.data.items import Bucket, MediaItem
from diffpipe_core.types import ModelConfigBase, ModelSpec

SPEC = ModelSpec(name="img", modality="image", config_schema=ModelConfigBase, spatial_multiple=16)
RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def item(path: Path, w: int, h: int, mask: Path | None = None) -> MediaItem:
    return MediaItem(id=path.name, path=path, caption="", bucket=Bucket(w, h), content_key="k", mask_path=mask)


def rgb(t: torch.Tensor, y: int, x: int) -> tuple[float, ...]:
    return tuple(round(float(v), 3) for v in t[:, y, x])


def stripes(path: Path) -> Path:
    """100x40: red columns 0-39, green 40-59, blue 60-99."""
    arr = np.zeros((40, 100, 3), np.uint8)
    arr[:, :40] = RED
    arr[:, 40:60] = GREEN
    arr[:, 60:] = BLUE
    Image.fromarray(arr).save(path)
    return path


def test_cover_resize_and_center_crop(tmp_path: Path) -> None:
    out = load_media(item(stripes(tmp_path / "s.png"), 32, 32), SPEC)
    # scale 0.8 -> 80x32; crop left (80-32)//2 = 24: red 24-31, green 32-47, blue 48-55 of the resized image
    assert out.pixels.shape == (3, 32, 32) and out.pixels.dtype == torch.float32
    assert out.original_size == (40, 100) and out.crop_coords == (0, 24)
    assert rgb(out.pixels, 16, 3) == (1.0, -1.0, -1.0)
    assert rgb(out.pixels, 16, 16) == (-1.0, 1.0, -1.0)
    assert rgb(out.pixels, 16, 28) == (-1.0, -1.0, 1.0)
    assert out.mask is None
    assert float(out.pixels.min()) >= -1.0 and float(out.pixels.max()) <= 1.0


def test_palette_with_transparency_is_composited_on_white(tmp_path: Path) -> None:
    im = Image.new("P", (32, 32), 0)
    im.putpalette([*RED, *GREEN] + [0] * (254 * 3))
    im.paste(1, (16, 0, 32, 32))
    path = tmp_path / "palette.png"
    im.save(path, transparency=0)  # index 0 (red in the palette) is transparent
    out = load_media(item(path, 32, 32), SPEC)
    assert rgb(out.pixels, 10, 4) == (1.0, 1.0, 1.0)
    assert rgb(out.pixels, 10, 27) == (-1.0, 1.0, -1.0)


def test_rgba_and_la_are_composited_on_white(tmp_path: Path) -> None:
    arr = np.zeros((32, 32, 4), np.uint8)
    arr[:, :16] = (0, 0, 0, 0)  # fully transparent black
    arr[:, 16:] = (0, 0, 255, 128)  # half-transparent blue
    Image.fromarray(arr, "RGBA").save(tmp_path / "rgba.png")
    out = load_media(item(tmp_path / "rgba.png", 32, 32), SPEC)
    assert rgb(out.pixels, 8, 4) == (1.0, 1.0, 1.0)
    r, g, b = rgb(out.pixels, 8, 28)
    assert abs(r - (127 / 127.5 - 1)) < 0.01 and abs(g - r) < 1e-6 and b == 1.0

    la = np.zeros((32, 32, 2), np.uint8)
    la[:, :, 0] = 0
    la[:16, :, 1] = 255  # top: opaque black; bottom: transparent
    Image.fromarray(la, "LA").save(tmp_path / "la.png")
    out = load_media(item(tmp_path / "la.png", 32, 32), SPEC)
    assert rgb(out.pixels, 4, 4) == (-1.0, -1.0, -1.0)
    assert rgb(out.pixels, 28, 4) == (1.0, 1.0, 1.0)


def test_16_bit_grayscale_keeps_its_precision(tmp_path: Path) -> None:
    arr = np.full((32, 32), 32832, np.uint16)  # 128.25 in 8-bit terms
    arr[:8] = 0
    arr[24:] = 65535
    path = tmp_path / "g16.png"
    Image.fromarray(arr).save(path)
    assert Image.open(path).mode == "I;16"
    out = load_media(item(path, 32, 32), SPEC)
    assert out.pixels.shape == (3, 32, 32)
    assert rgb(out.pixels, 2, 5) == (-1.0, -1.0, -1.0)
    assert rgb(out.pixels, 30, 5) == (1.0, 1.0, 1.0)
    mid = out.pixels[:, 16, 16]
    expected = 32832 / 65535 * 2 - 1  # 0.00198; an 8-bit path would give 128/255*2-1 = 0.00392
    assert torch.allclose(mid, torch.full((3,), expected), atol=1e-4)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    arr = np.zeros((32, 64, 3), np.uint8)  # stored 64 wide x 32 tall: left half black, right half white
    arr[:, 32:] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise: stored left column becomes the top row
    path = tmp_path / "rotated.jpg"
    Image.fromarray(arr).save(path, exif=exif, quality=98)
    assert probe_image(path) == (32, 64)
    out = load_media(item(path, 32, 64), SPEC)
    assert out.original_size == (64, 32) and out.crop_coords == (0, 0)
    assert float(out.pixels[:, 4:28].mean()) < -0.95  # top half: black
    assert float(out.pixels[:, 36:60].mean()) > 0.95  # bottom half: white


def test_large_jpeg_decoded_at_reduced_scale_matches_a_full_decode(tmp_path: Path) -> None:
    x = np.linspace(0, 255, 1024, dtype=np.float32)
    y = np.linspace(0, 255, 512, dtype=np.float32)
    arr = np.stack(
        [np.broadcast_to(x, (512, 1024)), np.broadcast_to(y[:, None], (512, 1024)), np.full((512, 1024), 90.0)], axis=-1
    ).astype(np.uint8)
    path = tmp_path / "big.jpg"
    Image.fromarray(arr).save(path, quality=95)
    out = load_media(item(path, 48, 48), SPEC)
    assert out.original_size == (512, 1024) and out.crop_coords == (0, 24)
    reference = Image.open(path).convert("RGB").resize((96, 48), Image.Resampling.LANCZOS).crop((24, 0, 72, 48))
    expected = torch.from_numpy(np.asarray(reference, np.float32)).permute(2, 0, 1) / 127.5 - 1
    assert (out.pixels - expected).abs().mean() < 0.02


def test_cmyk_and_grayscale(tmp_path: Path) -> None:
    Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg", quality=98)
    out = load_media(item(tmp_path / "cmyk.jpg", 32, 32), SPEC)
    r, g, b = rgb(out.pixels, 16, 16)
    assert r > 0.9 and g < -0.9 and b < -0.9
    Image.new("L", (32, 32), 51).save(tmp_path / "gray.png")
    out = load_media(item(tmp_path / "gray.png", 32, 32), SPEC)
    assert rgb(out.pixels, 3, 3) == (round(51 / 127.5 - 1, 3),) * 3


def test_mask_is_resized_and_cropped_like_its_image(tmp_path: Path) -> None:
    image = stripes(tmp_path / "s.png")
    mask = np.zeros((40, 100), np.uint8)
    mask[:, 40:60] = 255  # white exactly where the image is green
    Image.fromarray(mask).save(tmp_path / "m.png")
    out = load_media(item(image, 32, 32, mask=tmp_path / "m.png"), SPEC)
    assert out.mask is not None and out.mask.shape == (1, 32, 32) and out.mask.dtype == torch.float32
    assert float(out.mask.min()) >= 0.0 and float(out.mask.max()) <= 1.0
    green = out.pixels[1] > 0.5
    assert torch.equal(out.mask[0] > 0.5, green)
    assert float(out.mask[0, :, 16].min()) == 1.0 and float(out.mask[0, :, 3].max()) == 0.0


def test_decode_errors_name_the_file(tmp_path: Path) -> None:
    path = stripes(tmp_path / "cut me.png")
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(MediaError, match="cut me.png"):
        load_media(item(path, 32, 32), SPEC)
    Image.new("L", (10, 10)).save(tmp_path / "small_mask.png")
    good = stripes(tmp_path / "good.png")
    with pytest.raises(MediaError, match=r"small_mask.png is 10x10 but the media is 100x40"):
        load_media(item(good, 32, 32, mask=tmp_path / "small_mask.png"), SPEC)


def test_png_orientation_in_an_exif_chunk_after_the_pixels(tmp_path: Path) -> None:
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, 20:] = 255  # stored: left black, right white
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "late.png"
    Image.fromarray(arr).save(path, exif=exif)
    data = path.read_bytes()
    chunks, pos = [], 8
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        chunks.append(data[pos : pos + 12 + length])
        pos += 12 + length
    kinds = [c[4:8] for c in chunks]
    exif_chunk = chunks.pop(kinds.index(b"eXIf"))
    chunks.insert(len(chunks) - 1, exif_chunk)  # move it just before IEND, after IDAT
    path.write_bytes(data[:8] + b"".join(chunks))
    assert [c[4:8] for c in chunks][-2:] == [b"eXIf", b"IEND"]
    assert probe_image(path) == (20, 40)
    out = load_media(item(path, 20, 40), SPEC)
    assert float(out.pixels[:, :16].mean()) < -0.95 and float(out.pixels[:, 24:].mean()) > 0.95
