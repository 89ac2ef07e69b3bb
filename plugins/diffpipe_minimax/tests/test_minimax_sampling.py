"""MiniMax H3 samples: the plugin's denoising hooks under the core's loop equal ``MiniMaxH3ModularPipeline`` for the
same tiny model, prompt, seed and steps (its video noise then audio noise from one generator, its two schedulers at
shifts 12 and 3): the final video and audio latents, the decoded frames and the decoded stereo sound."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_minimax.layers import split
from diffpipe_minimax.packing import patchify
from diffpipe_minimax.plugin import plugin as minimax
from diffpipe_minimax.testing import modular_pipeline

PROMPT, STEPS, SEED, SIZE, FRAMES = "a red cat walks on the grass", 3, 5, 64, 124  # 124: the pipeline's 5 s minimum


def sampled(folder: Path, decoded: bool = True, **keys: object) -> tuple[object, torch.Tensor, dict]:
    """The ``[model]`` table of ``folder`` (and ``keys``), the plugin's sample under the core's loop, and the modular
    pipeline's state for the same prompt, seed and steps, its transformer the one the table loads; the final video and
    audio latents checked equal (``decoded``: the pipeline decodes them too)."""
    plugin = registered(minimax, "minimax-h3")
    cfg = minimax.spec.config_schema(type="minimax-h3", path=folder, dtype="float32", encoder_dtype="float32",
                                     text_max_length=16, **keys)
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], None, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, frames=FRAMES, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED)

    pipe = modular_pipeline(folder)
    pipe.update_components(transformer=minimax.load_diffusion_model(cfg, torch.device("cpu"), torch.float32).eval())
    state = pipe(prompt=PROMPT, height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS + 1,
                 generator=noise_generator(SEED, 0), output_type="pt",
                 output=["latents", "audio_latents", *(["videos", "audio"] if decoded else [])])
    latents, audio = state["latents"], state["audio_latents"]  # (1, C, F, h, w), (2, Ca, L)
    assert latents.shape == (1, 4, 37, 4, 4) and audio.shape == (2, 8, 207)
    video_rows, audio_rows = split(ours, (37 * 4, 16), (2 * 207, 8))
    torch.testing.assert_close(video_rows, patchify(latents, (1, 2, 2)), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(audio_rows[0], audio.permute(0, 2, 1).reshape(-1, 8), rtol=1e-4, atol=1e-4)
    return cfg, ours, state


def test_minimax_sample_with_sound_equals_the_modular_pipeline(tiny_minimax: Path) -> None:
    cfg, ours, state = sampled(tiny_minimax)
    plugin = registered(minimax, "minimax-h3")
    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    want = state["videos"][0].float()  # (F, 3, H, W) in [0, 1]
    assert pixels.shape == (3, FRAMES, SIZE, SIZE) and want.shape == (FRAMES, 3, SIZE, SIZE), want.shape
    torch.testing.assert_close((pixels + 1) / 2, want.permute(1, 0, 2, 3), rtol=1e-4, atol=1e-4)
    decoder = plugin.require("load_decoder", model_config=cfg, device=torch.device("cpu"))
    wave, rate = plugin.require("decode_audio", decoder=decoder, latents=ours)
    assert rate == 8000 and wave.shape[:2] == (1, 2)
    torch.testing.assert_close(wave[0], state["audio"][0].clamp(-1, 1), rtol=1e-4, atol=1e-4)


def test_a_sample_from_a_pruned_base_equals_the_pipeline_with_it(tiny_minimax: Path, tmp_path: Path) -> None:
    """The sampler steps on the same layers: from a pruned (curve-form) file the final latents equal the modular
    pipeline's with that transformer (diffusers' class in the curve form) in place of the folder's."""
    from diffpipe_minimax.pruned import CurveTimeEmbedding
    from diffpipe_minimax.testing import pruned_file

    cfg, _, _ = sampled(tiny_minimax, False, diffusion_model=pruned_file(tiny_minimax, tmp_path / "pruned.safetensors"))
    assert isinstance(minimax.load_diffusion_model(cfg, torch.device("meta"), torch.float32).time_embedder,
                      CurveTimeEmbedding)
