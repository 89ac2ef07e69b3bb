"""LTX-2.3 (``ltx-2.3``) and LTX-2.5 (``ltx-2.5``), issue 40: tiny folders with LTX-2.3's switches on
(``cross_attn_mod``, prompt adaLN, gated attention, per-stream connector projections, no caption projection; LTX-2.5:
static prompt tables, an ``LTX25ModularPipeline`` folder read from ``modular_model_index.json``, a Gemma 4 text
encoder).

The text is what ``LTX2Pipeline`` feeds the transformer and the layers chained equal its call with audio; the single
file (9-row tables, ``prompt_adaln_single``, ``to_gate_logits``, the per-stream ``*_aggregate_embed`` projections)
loads as the folder and as diffusers' converter reads it; samples equal ``LTX2Pipeline`` (2.3) and
``LTX25ModularPipeline`` with the convolutional VAE's decode step (2.5), video and sound; each entry point refuses
the other layout. The shared LTX-2.3 run (video and audio LoRA on tone clips) is in ``test_ltx23_train.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_ltx2_matches_pipeline import CALL, captured_call
from test_ltx2_sampling import assert_pipeline_sample

from diffpipe_core import EncodeBatch
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import validate
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_ltx.ltx2 import FRAME_RATE
from diffpipe_ltx.ltx2 import ltx2 as ltx2_plugin
from diffpipe_ltx.ltx2_layers import BETWEEN, split
from diffpipe_ltx.ltx2_testing import single_file_path
from diffpipe_ltx.ltx23 import ltx23, ltx25
from diffpipe_ltx.packing import unpack

CPU = torch.device("cpu")
LENGTH, PROMPT, STEPS, SEED, FRAMES, SIZE = 16, "a red car", 3, 5, 9, 64


def config(plugin, path: Path, **extra):
    table = {"type": plugin.spec.name, "path": path, "dtype": "float32", "encoder_dtype": "float32",
             "max_sequence_length": LENGTH, **extra}
    return validate(plugin.spec.config_schema, table, "test")


def run_layers(plugin, model, cfg, inputs: tuple) -> torch.Tensor:
    x = inputs
    for layer in plugin.split_into_layers(model=model, model_config=cfg):
        x = layer(x)
    return x[0]


def test_ltx23_text_and_layers_with_audio_as_ltx2_pipeline(tiny_ltx23: Path) -> None:
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(tiny_ltx23), local_files_only=True)
    assert pipe.transformer.config.cross_attn_mod and not pipe.transformer.config.use_prompt_embeddings
    assert pipe.transformer.transformer_blocks[0].scale_shift_table.shape[0] == 9
    captions = ["a red cat", "a photo of a dog on a tree with a car"]
    kw = captured_call(pipe, prompt=captions, generator=torch.Generator().manual_seed(0))
    cfg = config(ltx23, tiny_ltx23)
    encoders = ltx23.load_encoders(model_config=cfg, device=CPU)
    text = ltx23.encode_batch(encoders=encoders, batch=EncodeBatch(captions=captions))
    # each stream's width, from the connectors' own projections (no caption projection in the transformer)
    assert text["video_text"].shape == (2, LENGTH, 32) and text["audio_text"].shape == (2, LENGTH, 16)
    torch.testing.assert_close(text["video_text"], kw["encoder_hidden_states"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(text["audio_text"], kw["audio_encoder_hidden_states"], atol=1e-6, rtol=1e-6)
    assert torch.equal(text["text_mask"], kw["encoder_attention_mask"].bool())

    f, h, w = 2, 2, 2
    t = kw["timestep"].float() / 1000
    inputs = (kw["hidden_states"], t[:, None].expand(2, f), kw["audio_hidden_states"], text["video_text"],
              text["audio_text"], text["text_mask"], torch.tensor([f, h, w]))
    model = ltx23.load_diffusion_model(model_config=cfg, device=CPU, dtype=torch.float32)
    with torch.no_grad():
        expected_video, expected_audio = pipe.transformer(**{**kw, "return_dict": False})
        video, audio = split(run_layers(ltx23, model, cfg, inputs), f * h * w, 4, kw["audio_num_frames"])
    torch.testing.assert_close(video, expected_video, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(audio, expected_audio, atol=1e-5, rtol=1e-5)
    # the prompt adaLN's modulation of the text keys and values crosses every block boundary
    with torch.no_grad():
        assert len(ltx23.split_into_layers(model=model, model_config=cfg)[0](inputs)) == BETWEEN + 2


@pytest.mark.parametrize("name", ["ltx-2.3", "ltx-2.5"])
def test_the_single_file_loads_as_the_folder_and_as_diffusers_converts(name: str, request) -> None:
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    plugin, folder = (ltx23, request.getfixturevalue("tiny_ltx23")) if name == "ltx-2.3" else (
        ltx25, request.getfixturevalue("tiny_ltx25"))
    file = single_file_path(folder)
    a = plugin.load_diffusion_model(model_config=config(plugin, folder), device=CPU, dtype=torch.float32).state_dict()
    b = plugin.load_diffusion_model(model_config=config(plugin, folder, diffusion_model=file), device=CPU,
                                    dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    original = load_file(str(file))
    keys = ["transformer_blocks.0.scale_shift_table", "transformer_blocks.1.audio_prompt_scale_shift_table",
            "transformer_blocks.0.attn1.to_gate_logits.weight", "transformer_blocks.1.audio_attn2.to_gate_logits.bias"]
    if name == "ltx-2.3":  # LTX-2.5 has static prompt tables only
        keys += ["prompt_adaln_single.linear.weight", "audio_prompt_adaln_single.emb.timestep_embedder.linear_1.bias"]
    for key in keys:
        assert "model.diffusion_model." + key in original, key
    assert original["model.diffusion_model.transformer_blocks.0.scale_shift_table"].shape[0] == 9
    assert not any(k.startswith("model.diffusion_model.caption_projection") for k in original)
    transformer = {k: v for k, v in original.items() if k.startswith("model.diffusion_model.")}
    # diffusers' transformer converter predates LTX-2.3's prompt adaLN: it leaves ``prompt_adaln_single`` as it is,
    # which its LTX-2 LoRA converter (``_convert_non_diffusers_ltx2_lora_to_diffusers``) renames to ``prompt_adaln``
    theirs = {k.replace("prompt_adaln_single.", "prompt_adaln."): v
              for k, v in convert_ltx2_transformer_to_diffusers(transformer).items()}
    assert theirs.keys() == a.keys() and all(torch.equal(theirs[k], a[k]) for k in a)


def test_the_checkpoints_per_stream_text_projections_load_as_the_connectors(tiny_ltx23: Path, tmp_path: Path) -> None:
    """A checkpoint holding the connectors as released LTX-2.3 files do (LTX-2.3's feature extractor
    ``text_embedding_projection.video_aggregate_embed`` and ``audio_aggregate_embed``, beside
    ``model.diffusion_model.*_embeddings_connector``) gives the folder's connectors."""
    import json

    from safetensors.torch import save_file

    from diffpipe_ltx.ltx2_original import connectors_table

    connectors = ltx23.load_encoders(model_config=config(ltx23, tiny_ltx23), device=CPU).connectors
    table = connectors_table(json.loads((tiny_ltx23 / "connectors" / "config.json").read_text()))
    state = {k: v for k, v in load_file(str(single_file_path(tiny_ltx23))).items() if "connector" not in k
             and not k.startswith("text_embedding_projection.")}
    state.update(table.to_original(connectors.state_dict()))
    for stream in ("video", "audio"):
        assert f"text_embedding_projection.{stream}_aggregate_embed.bias" in state, sorted(state)[:5]
    save_file(state, str(tmp_path / "ltx-2.3.safetensors"))
    cfg = config(ltx23, tiny_ltx23, diffusion_model=tmp_path / "ltx-2.3.safetensors")
    assert "connectors" in ltx23.folder.component_files(tiny_ltx23, cfg)
    loaded = ltx23.load_encoders(model_config=cfg, device=CPU).connectors.state_dict()
    assert loaded.keys() == connectors.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in connectors.state_dict().items())


def test_each_entry_point_refuses_the_other_layout(tiny_ltx2: Path, tiny_ltx23: Path) -> None:
    with pytest.raises(ValueError, match=r"LTX-2.3-style transformer.*type = \"ltx-2.3\""):
        ltx2_plugin.build_skeleton(config(ltx2_plugin, tiny_ltx23), CPU, torch.float32)
    with pytest.raises(ValueError, match=r"an LTX-2.0 transformer.*type = \"ltx-2\""):
        ltx23.build_skeleton(config(ltx23, tiny_ltx2), CPU, torch.float32)
    assert any("ltx-2.3" in p for p in ltx2_plugin.validate_model_files(model_config=config(ltx2_plugin, tiny_ltx23)))
    # an LTX2Pipeline folder is not LTX-2.5's (LTX25ModularPipeline, modular_model_index.json)
    problems = ltx25.validate_model_files(model_config=config(ltx25, tiny_ltx23))
    assert problems and "LTX25ModularPipeline" in problems[0], problems


def ltx25_modular_pipeline(folder: Path):
    """``LTX25ModularPipeline`` of ``folder`` with its decode block swapped for the convolutional VAE's
    (``LTX2AutoDecoderStep``, as ``LTX25AutoBlocks``' docstring says) and guiders without guidance terms."""
    from diffusers.guiders import LTX2Guidance
    from diffusers.modular_pipelines import LTX25AutoBlocks
    from diffusers.modular_pipelines.ltx2.modular_blocks_ltx2 import LTX2AutoDecoderStep

    blocks = LTX25AutoBlocks()
    blocks.sub_blocks["decode"] = LTX2AutoDecoderStep()
    pipe = blocks.init_pipeline(str(folder))
    pipe.load_components(dtype=torch.float32)
    pipe.update_components(guider=LTX2Guidance(), audio_guider=LTX2Guidance())
    return pipe


def test_ltx25_folder_and_sample_equal_ltx25_modular_pipeline(tiny_ltx25: Path) -> None:
    """Read from ``modular_model_index.json``; the sample (video and audio latents, decoded video and sound) equals
    ``LTX25ModularPipeline`` with the convolutional VAE decoding, same seed, prompt and steps."""
    assert (tiny_ltx25 / "modular_model_index.json").is_file() and not (tiny_ltx25 / "model_index.json").exists()
    cfg = config(ltx25, tiny_ltx25)
    assert ltx25.validate_model_files(model_config=cfg) == []
    # LTX-2.5's text encoder generation, named by the folder's index: the text below goes through Gemma 4
    assert ltx25.folder.component_class("text_encoder", tiny_ltx25) == "Gemma4ForConditionalGeneration"
    plugin = registered(ltx25)
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], None, CPU)
    request = SampleRequest(width=SIZE, height=SIZE, frames=FRAMES, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED)

    pipe = ltx25_modular_pipeline(tiny_ltx25)
    out = pipe(prompt=PROMPT, height=SIZE, width=SIZE, num_frames=FRAMES, frame_rate=FRAME_RATE,
               num_inference_steps=STEPS, max_sequence_length=LENGTH, generator=noise_generator(SEED, 0),
               output_type="pt", output=["latents", "audio_latents", "videos", "audio"])
    f, h, w = 2, 2, 2
    video, audio = split(ours, f * h * w, 4, out["audio_latents"].shape[1])
    noise = torch.randn((1, 4, f, h, w), generator=noise_generator(SEED, 0))
    assert_same_sample(unpack(video, f, h, w), unpack(out["latents"], f, h, w), noise)
    torch.testing.assert_close(audio, out["audio_latents"], rtol=1e-4, atol=1e-4)

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, CPU)
    torch.testing.assert_close((pixels + 1) / 2, out["videos"][0].permute(1, 0, 2, 3), rtol=1e-3, atol=1e-3)
    wave, _ = ltx25.decode_audio(decoder=ltx25.load_decoder(model_config=cfg, device=CPU), latents=ours)
    torch.testing.assert_close(wave, out["audio"].float().clamp(-1, 1), rtol=1e-3, atol=1e-4)


def test_ltx23_sample_equals_ltx2_pipeline(tiny_ltx23: Path) -> None:
    """The video and audio latents (the decoding is LTX-2's code, compared with ``LTX2Pipeline`` in
    ``test_ltx2_sampling.py`` and with ``LTX25ModularPipeline`` above)."""
    from diffusers import LTX2Pipeline

    plugin = registered(ltx23)
    cfg = config(ltx23, tiny_ltx23)
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], None, CPU)
    ours = sample_latents(plugin, cfg, SampleRequest(width=SIZE, height=SIZE, frames=FRAMES, steps=STEPS), texts,
                          SEED)
    pipe = LTX2Pipeline.from_pretrained(str(tiny_ltx23), local_files_only=True)
    video_latents, audio_latents = pipe(**{**CALL, "prompt": PROMPT, "num_inference_steps": STEPS},
                                        generator=noise_generator(SEED, 0), return_dict=False)
    assert_pipeline_sample(ours, pipe, video_latents, audio_latents)
