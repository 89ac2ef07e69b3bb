"""Chroma in-process, against diffusers: the caption tensors equal ``ChromaPipeline.encode_prompt``'s (T5 run with
its attention mask, the mask keeping each caption's tokens and its first padding token), the layers chained equal
``ChromaTransformer2DModel.forward`` with the pipeline's mask, both on-disk layouts (the diffusers folder and
Chroma's original single file) load the same weights, each of 2 stages reads only its own tensors, the key names
are diffusers' own converter's, and the conformance kit passes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.chroma import plugin as chroma
from diffpipe_flux.config import ChromaConfig
from diffpipe_flux.testing import bfl_path

CAPTIONS = ["a red cat", "a photo of a dog on a tree"]


def table(path: Path, **kw) -> dict:
    return {"type": "chroma", "path": path, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 16, **kw}


def config(path: Path, **kw) -> ChromaConfig:
    return validate(ChromaConfig, table(path, **kw), "test")


def test_captions_equal_chroma_pipeline_encode_prompt(tiny_chroma: Path) -> None:
    from diffusers import ChromaPipeline

    enc = chroma.load_encoders(config(tiny_chroma), torch.device("cpu"))
    text = chroma.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    pipe = ChromaPipeline.from_pretrained(str(tiny_chroma), transformer=None, vae=None, local_files_only=True)
    embeds, _, mask, *_ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, max_sequence_length=16)
    assert set(text) == {"t5_embeds", "t5_mask"}
    torch.testing.assert_close(text["t5_embeds"], embeds, rtol=0, atol=1e-6)
    assert torch.equal(text["t5_mask"].float(), mask)
    # the mask keeps the caption's tokens and one padding token; T5 itself ran masked (unlike Flux's)
    lengths = enc.tokenizer(CAPTIONS, padding="max_length", max_length=16, return_tensors="pt").attention_mask.sum(1)
    assert text["t5_mask"].sum(1).tolist() == (lengths + 1).tolist()
    unmasked = enc.text_encoder(enc.tokenizer(CAPTIONS[:1], padding="max_length", max_length=16, return_tensors="pt")
                                .input_ids)[0]  # fmt: skip
    assert not torch.allclose(unmasked, text["t5_embeds"][:1], atol=1e-4)


def test_layers_compute_the_chroma_forward(tmp_path: Path) -> None:
    from diffpipe_flux.testing import TinyChromaConfig, write_tiny_chroma

    folder = write_tiny_chroma(tmp_path / "m", TinyChromaConfig(num_single_layers=3))
    cfg = config(folder)
    model = chroma.load_diffusion_model(cfg, torch.device("cpu"), torch.float32).eval()
    mask = torch.zeros(2, 16, dtype=torch.long)
    mask[0, :4], mask[1, :9] = 1, 1
    batch = {"latents": torch.randn(2, 4, 4, 6), "t5_embeds": torch.randn(2, 16, 32), "t5_mask": mask}
    inputs, targets = chroma.prepare_inputs(batch, TrainingContext(cfg), torch.Generator().manual_seed(0))
    x = inputs
    with torch.no_grad():
        for layer in chroma.split_into_layers(model, cfg):
            x = layer(x)
        # ChromaPipeline._prepare_attention_mask: the text mask (float) and ones over the image tokens
        joint = torch.cat([mask.float(), torch.ones(2, 6, dtype=torch.bool)], dim=1)
        expected = model(
            hidden_states=inputs[0],
            timestep=inputs[1],
            encoder_hidden_states=inputs[2],
            img_ids=inputs[4].float(),
            txt_ids=inputs[5].float(),
            attention_mask=joint,
        ).sample
        unmasked = model(
            hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
            img_ids=inputs[4].float(), txt_ids=inputs[5].float(),
        ).sample  # fmt: skip
    assert len(x) == 1 and x[0].shape == targets[0].shape == (2, 6, 16)
    torch.testing.assert_close(x[0], expected, rtol=0, atol=1e-5)
    assert (expected - unmasked).abs().max() > 1e-3  # the mask matters, so it is really passed through


def test_both_layouts_load_the_same_weights(tiny_chroma: Path) -> None:
    folder = chroma.load_diffusion_model(config(tiny_chroma), torch.device("cpu"), torch.float32).state_dict()
    single_cfg = config(tiny_chroma, diffusion_model=bfl_path(tiny_chroma))
    single = chroma.load_diffusion_model(single_cfg, torch.device("cpu"), torch.float32).state_dict()
    assert folder.keys() == single.keys() and len(folder) > 50
    for key in folder:
        assert torch.equal(folder[key], single[key]), key
    keys = set(load_file(str(bfl_path(tiny_chroma))))
    assert {"double_blocks.0.img_attn.qkv.weight", "distilled_guidance_layer.norms.0.scale"} <= keys
    assert not any("transformer_blocks" in k or "img_mod" in k for k in keys)


def test_original_keys_are_diffusers_converters() -> None:
    """diffusers' Chroma converter only handles the full-size inner dim (3072): compare names and shapes on meta."""
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    from diffpipe_flux.chroma_keys import layout_for_config as chroma_layout_for_config
    from diffpipe_flux.testing import TinyChromaConfig, tiny_chroma_transformer

    cfg = TinyChromaConfig(
        num_layers=1, num_single_layers=1, num_attention_heads=24, attention_head_dim=128,
        axes_dims_rope=(16, 56, 56), text_dim=4096, latent_channels=16, approximator_hidden_dim=64,
    )  # fmt: skip
    with torch.device("meta"):
        model = tiny_chroma_transformer(cfg)
    ours = chroma_layout_for_config(model.config).to_original(model.state_dict())
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(dict(ours))
    assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_single_file_is_read_per_stage(tiny_chroma: Path) -> None:
    plugin = get_registry().model("chroma")
    cfg = config(tiny_chroma, diffusion_model=bfl_path(tiny_chroma))
    first, second = assert_stages_read_their_own(plugin, cfg)
    assert set(first.reads) | set(second.reads) == set(load_file(str(bfl_path(tiny_chroma))))
    assert "distilled_guidance_layer.in_proj.weight" in first.reads and "final_layer.linear.weight" in second.reads


def test_chroma_plugin_conforms(tiny_chroma: Path) -> None:
    """From the original single file (the folder layout's loading is the one Flux's conformance test covers)."""
    model = table(tiny_chroma, diffusion_model=bfl_path(tiny_chroma))
    check_model_plugin(chroma, "chroma", model, torch.rand(2, 3, 32, 48) * 2 - 1, CAPTIONS)
