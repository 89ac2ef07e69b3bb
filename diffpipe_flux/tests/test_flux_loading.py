"""Issue point 1 (both on-disk layouts load to the same weights) and the model pieces against diffusers:
layers vs FluxTransformer2DModel.forward, packing vs FluxPipeline, encoders vs FluxPipeline.encode_prompt,
BFL key names vs diffusers' own converter, and clear errors on bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.schema import validate
from diffpipe_core.testing.layouts import assert_round_trip
from diffpipe_flux.bfl import bfl_to_diffusers, diffusers_to_bfl
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.packing import image_ids, pack, unpack
from diffpipe_flux.plugin import plugin as flux
from diffpipe_flux.testing import bfl_path


def config(path: Path, **kw) -> FluxConfig:
    table = {"type": "flux", "path": path, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 16, **kw}
    return validate(FluxConfig, table, "test")


def test_both_layouts_load_the_same_weights(tiny_flux: Path) -> None:
    folder = flux.load_diffusion_model(config(tiny_flux), torch.device("cpu"), torch.float32)
    single = flux.load_diffusion_model(
        config(tiny_flux, diffusion_model=bfl_path(tiny_flux)), torch.device("cpu"), torch.float32
    )
    a, b = folder.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and len(a) > 50
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the single file really is in the BFL layout (fused qkv, original names), not a diffusers dump
    keys = set(load_file(str(bfl_path(tiny_flux))))
    assert "double_blocks.0.img_attn.qkv.weight" in keys and "single_blocks.1.linear1.weight" in keys
    assert "final_layer.adaLN_modulation.1.weight" in keys and not any("transformer_blocks" in k for k in keys)


def test_bfl_key_names_match_diffusers_converter() -> None:
    """diffusers' converter only handles the full-size inner dim (3072); compare key names and shapes on meta."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from diffpipe_flux.testing import TinyFluxConfig, tiny_transformer

    cfg = TinyFluxConfig(
        num_layers=1, num_single_layers=1, num_attention_heads=24, attention_head_dim=128,
        axes_dims_rope=(16, 56, 56), text_dim=4096, clip_dim=768, latent_channels=16
    )
    with torch.device("meta"):
        model = tiny_transformer(cfg)
    ours = diffusers_to_bfl(model.state_dict())
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(ours))
    back = bfl_to_diffusers(ours)
    assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in back.items()}
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_bfl_round_trip_values_including_final_swap(tiny_flux: Path) -> None:
    state = load_file(str(tiny_flux / "transformer" / "diffusion_pytorch_model.safetensors"))
    final = ("final_layer.adaLN_modulation.1.weight", "norm_out.linear.weight")
    assert_round_trip(state, diffusers_to_bfl, bfl_to_diffusers, final)


def test_bad_single_file_names_file_and_key(tiny_flux: Path, tmp_path: Path) -> None:
    bad = load_file(str(bfl_path(tiny_flux)))
    bad["double_blocks.0.img_attn.extra.weight"] = torch.zeros(2)
    file = tmp_path / "bad.safetensors"
    save_file(bad, str(file))
    with pytest.raises(KeyError, match=r"bad\.safetensors.*unexpected.*double_blocks\.0\.img_attn\.extra\.weight"):
        flux.load_diffusion_model(config(tiny_flux, diffusion_model=file), torch.device("cpu"), torch.float32)
    del bad["double_blocks.0.img_attn.extra.weight"], bad["txt_in.bias"]
    save_file(bad, str(file))
    with pytest.raises(KeyError, match=r"bad\.safetensors.*missing key 'txt_in\.bias'"):
        flux.load_diffusion_model(config(tiny_flux, diffusion_model=file), torch.device("cpu"), torch.float32)
    bad["txt_in.bias"] = torch.zeros(3)
    save_file(bad, str(file))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*'context_embedder\.bias' has shape \(3,\)"):
        flux.load_diffusion_model(config(tiny_flux, diffusion_model=file), torch.device("cpu"), torch.float32)


def test_missing_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/transformer/config\.json"):
        flux.load_diffusion_model(config(tmp_path / "empty"), torch.device("cpu"), torch.float32)
    with pytest.raises(FileNotFoundError, match=r"empty/vae"):
        flux.load_encoders(config(tmp_path / "empty"), torch.device("cpu"))


def test_packing_matches_flux_pipeline() -> None:
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 6, 8)
    assert torch.equal(pack(x), FluxPipeline._pack_latents(x, 2, 4, 6, 8))
    assert torch.equal(unpack(pack(x), 6, 8), x)
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32)
    assert torch.equal(image_ids(6, 8).float(), ids)


def test_encoders_match_flux_pipeline(tiny_flux: Path) -> None:
    from diffusers import AutoencoderKL, FluxPipeline

    cfg = config(tiny_flux)
    enc = flux.load_encoders(cfg, torch.device("cpu"))
    captions = ["a red cat", "a photo of a dog on a tree"]
    text = flux.encode_batch(enc, EncodeBatch(captions=captions))
    pipe = FluxPipeline.from_pretrained(str(tiny_flux), transformer=None, vae=None, local_files_only=True)
    embeds, pooled, _ = pipe.encode_prompt(captions, prompt_2=None, max_sequence_length=16)
    assert torch.allclose(text["t5_embeds"], embeds, atol=1e-5)
    assert torch.allclose(text["clip_pooled"], pooled, atol=1e-5)
    assert not torch.equal(text["clip_pooled"][0], text["clip_pooled"][1])

    pixels = torch.rand(2, 3, 32, 48) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = flux.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    vae = AutoencoderKL.from_pretrained(str(tiny_flux / "vae"))
    expected = (vae.encode(pixels).latent_dist.mode() - 0.1159) * 0.3611
    assert media["latents"].shape == (2, 4, 4, 6)
    assert torch.allclose(media["latents"], expected, atol=1e-6)
    assert media["mask"].shape == (2, 1, 4, 6)
    assert media["mask"][:, :, :2].min() == 1 and media["mask"][:, :, 2:].max() == 0


@pytest.mark.parametrize("guidance", [True, False])
def test_layers_compute_the_diffusers_forward(tmp_path: Path, guidance: bool) -> None:
    from diffpipe_flux.testing import TinyFluxConfig, write_tiny_flux

    folder = write_tiny_flux(tmp_path / "m", TinyFluxConfig(guidance_embeds=guidance, num_single_layers=3))
    cfg = config(folder, guidance=3.5)
    model = flux.load_diffusion_model(cfg, torch.device("cpu"), torch.float32).eval()
    batch = {"latents": torch.randn(2, 4, 4, 6), "t5_embeds": torch.randn(2, 16, 32), "clip_pooled": torch.randn(2, 32)}
    inputs, targets = flux.prepare_inputs(batch, TrainingContext(cfg), torch.Generator().manual_seed(0))
    x = inputs
    with torch.no_grad():
        for layer in flux.split_into_layers(model, cfg):
            x = layer(x)
        expected = model(
            hidden_states=inputs[0],
            encoder_hidden_states=inputs[2],
            pooled_projections=inputs[3],
            timestep=inputs[1],
            img_ids=inputs[5].float(),
            txt_ids=inputs[6].float(),
            guidance=inputs[4] if guidance else None,
        ).sample
    assert len(x) == 1 and x[0].shape == targets[0].shape == (2, 6, 16)
    assert torch.allclose(x[0], expected, atol=1e-5), (x[0] - expected).abs().max()
