"""MiniMax H3 against diffusers, in-process: the text tensors against the modular pipeline's text encoder step, the
video latents against its keyframe encoder step, the audio latents against its reference encoder step; the pipeline
layers against ``MiniMaxH3Transformer3DModel.forward`` (with audio, items at their own times, a padded caption);
the training inputs' layout, targets and paired audio noise levels; the LoRA targets leave the AdaLN projections
out; the modular folder is validated and a wrong one named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_minimax.packing import audio_sigma, layout, model_times, patchify
from diffpipe_minimax.plugin import BLOCK_LINEARS
from diffpipe_minimax.plugin import plugin as minimax
from diffpipe_minimax.testing import TinyMiniMaxConfig, load_components, tiny_transformer

CPU = torch.device("cpu")
CAPTIONS = ["a red cat", "a red cat walks on the grass"]
PATCH = (1, 2, 2)


def config(folder: Path, **keys: object):
    return minimax.spec.config_schema(type="minimax-h3", path=folder, dtype="float32", encoder_dtype="float32",
                                      text_max_length=12, **keys)


def step_pipeline(step: type, folder: Path, *names: str):
    """A modular pipeline of one of the MiniMax H3 blocks over the folder's components ``names``."""
    pipe = step().init_pipeline()
    components = load_components(folder)
    pipe.update_components(**{name: components[name] for name in names})
    return pipe


def test_text_tensors_equal_the_pipeline_text_encoder_step(tiny_minimax: Path) -> None:
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    enc = minimax.load_encoders(config(tiny_minimax), CPU)
    out = minimax.encode_batch(enc, EncodeBatch(captions=[*CAPTIONS, ""]))
    pipe = step_pipeline(MiniMaxH3TextEncoderStep, tiny_minimax, "text_encoder", "tokenizer", "processor")
    assert out["text_embeds"].shape == (3, 12, 32) and out["text_mask"].dtype == torch.bool
    lengths = []
    for i, caption in enumerate(CAPTIONS):
        want = pipe(prompt=caption, output="prompt_embeds")[0].float()
        n = want.shape[0]
        lengths.append(n)
        assert int(out["text_mask"][i].sum()) == n and bool(out["text_mask"][i, :n].all())
        torch.testing.assert_close(out["text_embeds"][i, :n], want, rtol=0, atol=0)
        assert not out["text_embeds"][i, n:].any()
    assert lengths[1] > lengths[0]
    assert not out["text_mask"][2].any() and not out["text_embeds"][2].any()  # the empty caption: no tokens


def test_a_caption_over_text_max_length_is_refused_by_name(tiny_minimax: Path) -> None:
    enc = minimax.load_encoders(config(tiny_minimax).model_copy(update={"text_max_length": 3}), CPU)
    with pytest.raises(ValueError, match=r"caption 'a red cat walks.*Qwen3-VL tokens, over \[model\] text_max_length"):
        minimax.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))


def test_video_latents_equal_the_pipeline_vae_encoding(tiny_minimax: Path) -> None:
    import numpy as np
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep
    from PIL import Image

    enc = minimax.load_encoders(config(tiny_minimax), CPU)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 3, 64, 96), generator=g).float() / 127.5 - 1
    out = minimax.encode_batch(enc, EncodeBatch(pixels=images))
    pipe = step_pipeline(MiniMaxH3KeyframeVaeEncoderStep, tiny_minimax, "vae")
    frames = [Image.fromarray(((img + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()) for img in images]
    want = pipe(keyframes=frames, output="condition_latents")
    assert out["latents"].shape == (2, 4, 1, 4, 6)
    torch.testing.assert_close(out["latents"], torch.cat(want), rtol=0, atol=1e-6)
    # a clip of 5 frames (17 n + 5) as the pipeline's video references go through the same encoding
    clip = torch.rand(1, 3, 5, 64, 64, generator=g) * 2 - 1
    latents = minimax.encode_batch(enc, EncodeBatch(pixels=clip))["latents"]
    assert latents.shape == (1, 4, 2, 4, 4) and np.isfinite(latents.numpy()).all()


def test_audio_latents_equal_the_pipeline_reference_encoding(tiny_minimax: Path) -> None:
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3AudioReference

    enc = minimax.load_encoders(config(tiny_minimax, train_audio=True), CPU)
    rate = enc.audio_vae.config.sampling_rate
    frames = 5
    g = torch.Generator().manual_seed(1)
    wave = torch.rand(2, 2, round(frames / 24 * rate), generator=g) * 2 - 1
    pixels = torch.rand(2, 3, frames, 64, 64, generator=g) * 2 - 1
    batch = EncodeBatch(pixels=pixels, audio=wave, audio_present=torch.tensor([True, False]))
    out = minimax.encode_batch(enc, batch)
    pipe = step_pipeline(MiniMaxH3Ref2VAReferenceEncoderStep, tiny_minimax, "vae", "audio_vae")
    for i in range(2):
        reference = MiniMaxH3AudioReference(audio=wave[i], sample_rate=rate)
        (want,) = pipe(normalized_references=[reference], output="audio_condition_latents")
        # the VAE makes 9 latents a channel of the 167 samples; the pipeline generates 8 for 5 frames at 24 fps
        assert want.shape == (2 * 9, 8) and out["audio_latents"][i].shape == (2 * 8, 8)
        cut = want.view(2, 9, 8)[:, :8].reshape(16, 8)
        torch.testing.assert_close(out["audio_latents"][i], cut, rtol=0, atol=1e-6)
    assert out["audio_mask"].tolist() == [1.0, 0.0]


def forward(model, video, audio, text, times, text_len, shape, audio_len):
    """``MiniMaxH3Transformer3DModel.forward`` of one item on the pipeline's own layout and unique timesteps."""
    lay = layout(text_len, shape, audio_len, PATCH)
    per_row = torch.where(lay.timestep_indices == 1, times[1], times[0])
    timestep, indices = torch.unique(per_row, sorted=True, return_inverse=True)
    with torch.no_grad():
        return model(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text, timestep=timestep,
                     timestep_indices=indices, token_tags=lay.token_tags, position_ids=lay.position_ids,
                     video_indices=lay.video_indices, audio_indices=lay.audio_indices,
                     text_indices=torch.arange(text_len), return_dict=False)


def run_layers(model, inputs):
    """The layers chained: the video and the audio rows of the head's joined output."""
    from diffpipe_minimax.layers import split

    x = inputs
    with torch.no_grad():
        for layer in minimax.split_into_layers(model, None):
            x = layer(x)
    return split(x[0], tuple(inputs[0].shape[1:]), tuple(inputs[1].shape[1:]))


def test_layers_compute_the_diffusers_forward() -> None:
    model = tiny_transformer(TinyMiniMaxConfig()).eval()
    g = torch.Generator().manual_seed(2)
    shape, audio_len, n = (2, 4, 4), 5, 6
    latents = torch.randn(2, 4, *shape, generator=g)
    audio = torch.randn(2, 2 * audio_len, 8, generator=g)
    text = torch.randn(2, n, 32, generator=g)
    mask = torch.ones(2, n, dtype=torch.bool)
    times = model_times(torch.tensor([0.3, 0.9]), torch.tensor([0.5, 0.2]))  # each item at its own times
    lay = layout(n, shape, audio_len, PATCH)
    inputs = (patchify(latents, PATCH), audio, times, lay.timestep_indices, lay.token_tags, lay.position_ids.float(),
              text, mask, lay.video_indices, lay.audio_indices)
    video_out, audio_out = run_layers(model, inputs)
    for i in range(2):
        want = forward(model, patchify(latents[i : i + 1], PATCH), audio[i : i + 1], text[i : i + 1], times[i], n,
                       shape, audio_len)
        torch.testing.assert_close(video_out[i : i + 1], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(audio_out[i : i + 1], want[1], rtol=1e-5, atol=1e-5)
    # a shorter caption padded in the micro-batch: its padding is hidden, whatever it holds
    mask[1, 4:] = False
    padded = list(inputs)
    padded[7] = mask
    first = run_layers(model, tuple(padded))
    padded[6] = text.clone()
    padded[6][1, 4:] = 100.0
    second = run_layers(model, tuple(padded))
    torch.testing.assert_close(first[0], second[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(first[0][0], video_out[0], rtol=1e-5, atol=1e-5)  # the other item is untouched
    # no sound: no audio rows (the layout of a video without audio track)
    lay = layout(n, shape, 0, PATCH)
    silent = (patchify(latents[:1], PATCH), audio[:1, :0], times[:1], lay.timestep_indices, lay.token_tags,
              lay.position_ids.float(), text[:1], torch.ones(1, n, dtype=torch.bool), lay.video_indices,
              lay.audio_indices)
    want = forward(model, silent[0], silent[1], text[:1], times[0], n, shape, 0)
    torch.testing.assert_close(run_layers(model, silent)[0], want[0], rtol=1e-5, atol=1e-5)


def test_audio_noise_levels_pair_as_the_pipeline_schedulers() -> None:
    from diffusers import MiniMaxH3Scheduler

    video, sound = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video.set_timesteps(9)
    sound.set_timesteps(9)
    torch.testing.assert_close(audio_sigma(video.sigmas, 12.0, 3.0), sound.sigmas, rtol=0, atol=1e-6)


def test_training_inputs(tiny_minimax: Path) -> None:
    cfg = config(tiny_minimax, train_audio=True)
    g = torch.Generator().manual_seed(3)
    batch = {"latents": torch.randn(2, 4, 2, 4, 4, generator=g), "audio_latents": torch.randn(2, 16, 8, generator=g),
             "audio_mask": torch.tensor([1.0, 0.0]), "text_embeds": torch.randn(2, 12, 32, generator=g),
             "text_mask": torch.zeros(2, 12, dtype=torch.bool)}
    batch["text_mask"][0, :5], batch["text_mask"][1, :3] = True, True
    context = TrainingContext(model_config=cfg)
    inputs, targets = minimax.prepare_inputs(batch, context, torch.Generator().manual_seed(4))
    again, _ = minimax.prepare_inputs(batch, context, torch.Generator().manual_seed(4))
    assert all(torch.equal(a, b) for a, b in zip(inputs, again, strict=True))
    video, audio, times, _, tags, positions, text, mask, vidx, aidx = inputs
    assert text.shape == (2, 5, 32) and mask[1].tolist() == [True] * 3 + [False] * 2
    # x_t = (1 - s) x0 + s noise and the target x0 - noise: x_t + s * target = x0, at t = 1 - s
    s = 1 - times[:, 0].view(2, 1, 1)
    torch.testing.assert_close(video + s * targets[0], patchify(batch["latents"], PATCH), rtol=0, atol=1e-5)
    sa = 1 - times[:, 1].view(2, 1, 1)
    torch.testing.assert_close(audio + sa * targets[1], batch["audio_latents"], rtol=0, atol=1e-5)
    torch.testing.assert_close(1 - times[:, 1], audio_sigma(1 - times[:, 0], 12.0, 3.0))
    assert targets[3][0].min() == 1 and targets[3][1].max() == 0  # the item without sound: outside the loss
    assert tags[aidx].eq(2).all() and tags[vidx].eq(0).all() and tags[:5].eq(1).all()
    assert positions[aidx[0], 0] == 5 and positions[vidx[0], 0] == 5  # the media clock starts after the text
    # no sound in the micro-batch: no audio rows
    quiet, _ = minimax.prepare_inputs({**batch, "audio_mask": torch.zeros(2)}, context, torch.Generator())
    assert quiet[1].shape == (2, 0, 8) and quiet[9].numel() == 0


def test_lora_targets_leave_the_adaln_projections_out(tiny_minimax: Path) -> None:
    targets = minimax.lora_targets(config(tiny_minimax))
    model = minimax.load_diffusion_model(config(tiny_minimax), CPU, torch.float32)
    matched = {name for name, _ in model.named_modules() if any(name.endswith("." + t) for t in targets)}
    assert matched == {f"{block}.{linear}" for block in ("transformer_blocks.0", "transformer_blocks.1",
                                                         "token_refiner.refiner_blocks.0") for linear in BLOCK_LINEARS}
    assert not [name for name in matched if "adaln" in name or name.startswith("norm_out")]


def test_the_modular_folder_validates_and_a_wrong_one_is_named(tiny_minimax: Path, tmp_path: Path) -> None:
    assert minimax.validate_model_files(config(tiny_minimax)) == []
    index = json.loads((tiny_minimax / "modular_model_index.json").read_text())
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "modular_model_index.json").write_text(json.dumps({**index, "_class_name": "AnimaModularPipeline"}))
    (problem,) = minimax.validate_model_files(config(wrong))
    assert "modular_model_index.json: the pipeline is 'AnimaModularPipeline'" in problem
    assert "'MiniMaxH3ModularPipeline'" in problem


def test_the_reference_key_table_is_diffusers_converter_inverted() -> None:
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    from diffpipe_minimax.original import layout_for_config

    model = tiny_transformer(TinyMiniMaxConfig())
    state = model.state_dict()
    original = layout_for_config(dict(model.config)).to_original(state)
    assert "blocks.0.attn.qkv_proj.weight" in original and "token_refiner.blocks.0.mlp.fc1.weight" in original
    back = convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(original), dict(model.config))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_encoder_quantize_loads_qwen3_vl_quantized_for_caching(tiny_minimax: Path) -> None:
    """Issue 40: ``encoder_quantize = "nf4"`` (the core key) loads Qwen3-VL's language-model linears as bitsandbytes
    nf4 while caching; the text tensors equal the full encoder's with those weights put through bitsandbytes' nf4
    round trip (:func:`diffpipe_core.testing.quantized.nf4_round_trip`), and differ from the full encoder's."""
    from bitsandbytes.nn import Linear4bit

    from diffpipe_core.testing.quantized import nf4_round_trip

    enc = minimax.load_encoders(config(tiny_minimax, encoder_quantize="nf4"), CPU)
    assert isinstance(enc.text_encoder.model.language_model.layers[0].self_attn.q_proj, Linear4bit)
    got = minimax.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))
    full = minimax.load_encoders(config(tiny_minimax), CPU)
    want = minimax.encode_batch(full, EncodeBatch(captions=list(CAPTIONS)))
    assert torch.equal(got["text_mask"], want["text_mask"]) and not torch.equal(got["text_embeds"], want["text_embeds"])
    assert nf4_round_trip(full.text_encoder, enc.text_encoder) > 0
    reference = minimax.encode_batch(full, EncodeBatch(captions=list(CAPTIONS)))
    torch.testing.assert_close(got["text_embeds"], reference["text_embeds"], rtol=1e-4, atol=1e-5)
