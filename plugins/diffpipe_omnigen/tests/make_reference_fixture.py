"""Writes ``fixtures/reference_forward.safetensors``: the reference OmniGen2 transformer's outputs on a tiny model.

Run once, with the reference implementation (github.com/VectorSpaceLab/OmniGen2, its ``omnigen2`` package: e.g.
``git archive HEAD omnigen2 | tar x -C /tmp/og2ref``) and einops importable, never in the test suite:

    PYTHONPATH=/tmp/og2ref:/tmp/refdeps python plugins/diffpipe_omnigen/tests/make_reference_fixture.py

The tiny weights are not stored: both sides fill them with ``diffpipe_omnigen.testing.seeded_weights`` (a seed
per tensor name). Stored: the inputs (latents, times, caption features and mask, reference latents) and the
reference's outputs of ``OmniGen2Transformer2DModel.forward`` and of its pipeline's sampling loop
(``OmniGen2Pipeline.processing`` up to the VAE: its scheduler, text guidance, ``cfg_range``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).parent / "fixtures" / "reference_forward.safetensors"


def main() -> None:
    from omnigen2.models.transformers.repo import OmniGen2RotaryPosEmbed
    from omnigen2.models.transformers.transformer_omnigen2 import OmniGen2Transformer2DModel
    from omnigen2.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    from diffpipe_omnigen.testing import TINY_TRANSFORMER, reference_inputs, seeded_weights

    model = OmniGen2Transformer2DModel(**TINY_TRANSFORMER).eval()
    model.load_state_dict(seeded_weights(model.state_dict()))
    inputs = reference_inputs()
    freqs = OmniGen2RotaryPosEmbed.get_freqs_cis(model.config.axes_dim_rope, model.config.axes_lens, theta=10000)
    out = {}
    with torch.no_grad():
        refs = [[inputs["ref0"], inputs["ref1"]], None]
        out["out_with_refs"] = model(inputs["latents"], inputs["t"], inputs["text"], freqs, inputs["mask"],
                                     ref_image_hidden_states=refs)
        out["out_text_only"] = model(inputs["latents"], inputs["t"], inputs["text"], freqs, inputs["mask"],
                                     ref_image_hidden_states=None)
        # OmniGen2Pipeline.processing (text guidance 4.0 over cfg_range (0, 1), no reference image), before the VAE
        scheduler = FlowMatchEulerDiscreteScheduler()
        latents = inputs["noise"].clone()
        scheduler.set_timesteps(3, num_tokens=latents.shape[-2] * latents.shape[-1])
        out["sample_timesteps"] = scheduler.timesteps.clone()
        for t in scheduler.timesteps:
            ts = t.expand(1)
            cond = model(latents, ts, inputs["text"][:1], freqs, inputs["mask"][:1])
            uncond = model(latents, ts, inputs["negative"], freqs, inputs["negative_mask"])
            latents = scheduler.step(uncond + 4.0 * (cond - uncond), t, latents, return_dict=False)[0]
        out["sample"] = latents
    save_file({**inputs, **{k: v.contiguous() for k, v in out.items()}}, str(OUT))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
