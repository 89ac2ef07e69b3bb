"""FLUX.2 [klein] in-process, against diffusers: the caption tensors equal ``Flux2KleinPipeline.encode_prompt``'s
(Qwen3 on the chat template, hidden layers 9, 18 and 27 side by side), the latents its ``_encode_vae_image``'s (the
mode in 2x2 patches, batch-norm normalised), the layers chained equal ``Flux2Transformer2DModel.forward``, both
on-disk layouts (the diffusers folder and the BFL / ComfyUI single file) load the same weights, which are what
diffusers' own FLUX.2 converter makes of the file, each of 2 stages reads only its own tensors, and the conformance
kit passes (LoRA gradients on every default target included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.schema import validate
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.config import Flux2KleinConfig
from diffpipe_flux.flux2 import klein
from diffpipe_flux.testing import bfl_path

CAPTIONS = ["a red cat", "a photo of a dog on a tree"]


def table(path: Path, **kw) -> dict:
    return {"type": "flux2-klein", "path": path, "dtype": "float32", "encoder_dtype": "float32",
            "text_max_length": 16, **kw}  # fmt: skip


def config(path: Path, **kw) -> Flux2KleinConfig:
    return validate(Flux2KleinConfig, table(path, **kw), "test")


def test_captions_equal_klein_encode_prompt(tiny_klein: Path) -> None:
    from diffusers import Flux2KleinPipeline

    enc = klein.load_encoders(config(tiny_klein), torch.device("cpu"))
    text = klein.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    pipe = Flux2KleinPipeline.from_pretrained(str(tiny_klein), transformer=None, vae=None, local_files_only=True)
    embeds, _ = pipe.encode_prompt(list(CAPTIONS), max_sequence_length=16)
    assert set(text) == {"text_embeds"} and text["text_embeds"].shape == (2, 16, 3 * 16)
    torch.testing.assert_close(text["text_embeds"], embeds, rtol=0, atol=1e-6)
    # the first third is hidden layer 9 of Qwen3 on the chat-templated caption (not on the bare caption)
    chat = enc.tokenizer.apply_chat_template(
        [{"role": "user", "content": CAPTIONS[0]}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert chat.startswith("<|im_start|>user\n") and chat.endswith("</think>\n\n")
    ids = enc.tokenizer(chat, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = enc.text_encoder(**ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(text["text_embeds"][:1, :, :16], hidden[9], rtol=0, atol=1e-6)
    assert not torch.allclose(hidden[9], hidden[27], atol=1e-3)


def test_latents_equal_the_pipelines(tiny_klein: Path) -> None:
    from diffusers import AutoencoderKLFlux2

    from diffpipe_core.parts.text import text_pipeline
    from diffpipe_flux.flux2_latents import patchify

    enc = klein.load_encoders(config(tiny_klein), torch.device("cpu"))
    pixels = torch.rand(2, 3, 32, 48) * 2 - 1
    ours = klein.encode_batch(enc, EncodeBatch(pixels=pixels))["latents"]
    vae = AutoencoderKLFlux2.from_pretrained(str(tiny_klein / "vae"), local_files_only=True)
    with torch.no_grad():
        expected = text_pipeline("Flux2KleinPipeline", vae=vae)._encode_vae_image(pixels, None)
        plain = patchify(vae.encode(pixels).latent_dist.mode())
    assert ours.shape == (2, 16, 2, 3)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert (ours - plain).abs().max() > 0.1  # the batch-norm statistics are applied
    # and undone before decoding: the VAE gets back its own latents
    torch.testing.assert_close(klein.denormalize(ours, vae), vae.encode(pixels).latent_dist.mode(), rtol=0, atol=1e-5)


def test_layers_compute_the_flux2_forward(tiny_klein: Path) -> None:
    cfg = config(tiny_klein)
    model = klein.load_diffusion_model(cfg, torch.device("cpu"), torch.float32).eval()
    batch = {"latents": torch.randn(2, 16, 2, 3), "text_embeds": torch.randn(2, 16, 48)}
    inputs, targets = klein.prepare_inputs(batch, TrainingContext(cfg), torch.Generator().manual_seed(0))
    x = inputs
    with torch.no_grad():
        for layer in klein.split_into_layers(model, cfg):
            x = layer(x)
        expected = model(
            hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2], guidance=None,
            img_ids=inputs[4][None], txt_ids=inputs[5][None],
        ).sample  # fmt: skip
    assert len(x) == 1 and x[0].shape == targets[0].shape == (2, 6, 16)
    torch.testing.assert_close(x[0], expected, rtol=0, atol=1e-5)
    assert inputs[5][:, 3].tolist() == list(range(16)) and inputs[4][4].tolist() == [0, 1, 1, 0]


def test_both_layouts_load_the_same_weights_as_diffusers_converts_them(tiny_klein: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    folder = klein.load_diffusion_model(config(tiny_klein), torch.device("cpu"), torch.float32).state_dict()
    single_cfg = config(tiny_klein, transformer_file=bfl_path(tiny_klein))
    single = klein.load_diffusion_model(single_cfg, torch.device("cpu"), torch.float32).state_dict()
    original = load_file(str(bfl_path(tiny_klein)))
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(dict(original))
    assert folder.keys() == single.keys() == theirs.keys() and len(folder) > 40
    for key in folder:
        assert torch.equal(folder[key], single[key]) and torch.equal(folder[key], theirs[key]), key
    assert {"double_stream_modulation_img.lin.weight", "double_blocks.0.img_attn.qkv.weight",
            "single_blocks.1.linear1.weight", "final_layer.adaLN_modulation.1.weight"} <= set(original)  # fmt: skip
    assert not any("transformer_blocks" in k or "guidance_in" in k for k in original)


def test_single_file_is_read_per_stage(tiny_klein: Path) -> None:
    from diffpipe_core.registry import get_registry

    cfg = config(tiny_klein, transformer_file=bfl_path(tiny_klein))
    first, second = assert_stages_read_their_own(get_registry().model("flux2-klein"), cfg)
    assert set(first.reads) | set(second.reads) == set(load_file(str(bfl_path(tiny_klein))))
    assert "double_stream_modulation_img.lin.weight" in first.reads and "final_layer.linear.weight" in second.reads


def test_a_flux1_folder_is_refused(tiny_flux: Path) -> None:
    from diffpipe_core.registry import get_registry

    problems = get_registry().model("flux2-klein").call("validate_model_files", model_config=config(tiny_flux))
    assert any("Flux2KleinPipeline" in p or "Flux2Transformer2DModel" in p for p in problems), problems


@pytest.mark.parametrize("layout", ["bfl"])  # the folder layout's loading: the tests above
def test_klein_plugin_conforms(tiny_klein: Path, layout: str) -> None:
    model = table(tiny_klein, transformer_file=bfl_path(tiny_klein))
    check_model_plugin(klein, "flux2-klein", model, torch.rand(2, 3, 32, 48) * 2 - 1, CAPTIONS)
