"""diffpipe's OmniGen2 transformer and sampling loop against figures computed once from the reference implementation
(VectorSpaceLab/OmniGen2, ``tests/make_reference_fixture.py``; the fixture's README line says how): the same tiny
weights (a seed per tensor name) give the reference's outputs, with and without reference images, and the plugin's
denoising hooks under the core's loop give the reference pipeline's sampled latents (its scheduler's dynamic time
shift, text guidance 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.sampling.loop import PromptText
from diffpipe_core.testing.sampling import registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_omnigen.plugin import plugin as omnigen
from diffpipe_omnigen.testing import SAMPLE_SEED, reference_inputs, tiny_config, tiny_transformer

FIXTURE = Path(__file__).parent / "fixtures" / "reference_forward.safetensors"


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE))


def test_fixture_inputs_are_the_seeded_ones(reference: dict) -> None:
    for name, value in reference_inputs().items():
        assert torch.equal(reference[name], value), name


def test_forward_equals_the_reference_implementation(reference: dict) -> None:
    model = tiny_transformer()
    r = reference
    with torch.no_grad():
        with_refs = model(r["latents"], r["t"], r["text"], r["mask"], [[r["ref0"], r["ref1"]], None])
        text_only = model(r["latents"], r["t"], r["text"], r["mask"])
    assert with_refs.shape == (2, 4, 8, 6)
    torch.testing.assert_close(with_refs, r["out_with_refs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(text_only, r["out_text_only"], rtol=1e-5, atol=1e-5)
    assert (r["out_with_refs"][0] - r["out_text_only"][0]).abs().max() > 0.1  # the references change sample 0
    torch.testing.assert_close(with_refs[1], text_only[1], rtol=1e-5, atol=1e-5)  # and not sample 1


def test_sample_equals_the_reference_pipeline_loop(reference: dict, tmp_path: Path) -> None:
    """The tiny folder with the fixture's transformer weights; the cached text tensors are the fixture's; 3 steps
    at 64x64 pixels (8x8 latents: the scheduler's ``m = 8 / 40``), guidance 4."""
    from diffpipe_omnigen.testing import write_tiny_omnigen2

    folder = write_tiny_omnigen2(tmp_path / "og")
    plugin = registered(omnigen, "omnigen2")
    cfg = tiny_config(folder)
    r = reference
    times = omnigen.denoise_init(SampleRequest(width=64, height=64, steps=3), cfg, torch.Generator())[1]
    torch.testing.assert_close(times[:-1], r["sample_timesteps"], rtol=0, atol=0)
    # the cache holds every caption at one length (text_max_length): the negative padded like the prompt
    negative = torch.zeros(1, 7, 32)
    negative[:, :3] = r["negative"]
    negative_mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0]])
    texts = PromptText({"text_embeds": r["text"][:1], "text_mask": r["mask"][:1]},
                       {"text_embeds": negative, "text_mask": negative_mask})
    ours = sample_latents(plugin, cfg, SampleRequest(width=64, height=64, steps=3), texts, SAMPLE_SEED, cfg_scale=4.0)
    torch.testing.assert_close(ours, r["sample"], rtol=1e-5, atol=1e-5)
    assert (ours - r["noise"]).abs().max() > 0.1  # denoised
