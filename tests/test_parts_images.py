"""``diffpipe_core.parts.images``: frames in [-1, 1] decoded from 8-bit media go back to the exact 8-bit images."""

from __future__ import annotations

import numpy as np
import torch

from diffpipe_core.parts.images import to_pil_images


def test_frames_round_trip_to_their_8_bit_images() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (2, 6, 5, 3), dtype=np.uint8)
    frames = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255 * 2 - 1  # as diffusers' preprocess does
    images = to_pil_images(frames)
    assert [im.size for im in images] == [(5, 6), (5, 6)] and images[0].mode == "RGB"
    assert np.array_equal(np.stack([np.asarray(im) for im in images]), pixels)
