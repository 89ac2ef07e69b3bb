"""``diffpipe_core.parts.sampling.SampleImageConditioning``: the sample image's conditioning is encoded once per image
and size, before the model's own ``denoise_init``; without ``[model] sample_image`` the error says what to set."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from diffpipe_core.parts.sampling import SampleImageConditioning
from diffpipe_core.types import SampleRequest


class Base:
    def denoise_init(self, request, model_config, generator):
        return "noise", "schedule"


class Model(SampleImageConditioning, Base):
    spec = SimpleNamespace(name="tiny-i2v")

    def __init__(self) -> None:
        self.encoded: list[tuple[int, int]] = []

    def encode_sample_image(self, model_config, request):
        self.encoded.append((request.width, request.height))
        return {"condition": len(self.encoded)}


def test_conditioning_is_encoded_once_per_size_before_the_model_starts() -> None:
    model, cfg = Model(), SimpleNamespace(path=Path("m"), sample_image=Path("first.png"))
    small, large = SampleRequest(width=32, height=32, frames=5), SampleRequest(width=64, height=32, frames=5)
    assert model.denoise_init(small, cfg, None) == ("noise", "schedule")
    assert model.sample_condition(cfg, small) == {"condition": 1}
    model.denoise_init(large, cfg, None)
    assert model.sample_condition(cfg, large) == {"condition": 2} and model.encoded == [(32, 32), (64, 32)]
    with pytest.raises(ValueError, match=r"tiny-i2v samples .* set \[model\] sample_image"):
        model.sample_condition(SimpleNamespace(path=Path("m"), sample_image=None), small)
