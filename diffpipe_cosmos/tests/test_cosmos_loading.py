"""Issue point 1 (both on-disk layouts load to the same weights, for both entry points) and the model pieces
against diffusers: layers vs CosmosTransformer3DModel.forward, encoders vs the pipelines' prompt encoding and
latent normalisation, original key names vs diffusers' converter; validate_model_files and clear errors."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from cosmos_common import PLUGINS, config
from safetensors.torch import load_file, save_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_cosmos import resize
from diffpipe_cosmos.plugin import cosmos1, predict2
from diffpipe_cosmos.testing import TinyCosmosConfig, original_path, tiny_transformer, to_diffusers


@pytest.mark.parametrize("name", ["cosmos", "cosmos-predict2"])
def test_both_layouts_load_the_same_weights(tiny_models: dict[str, Path], name: str) -> None:
    folder, plugin = tiny_models[name], PLUGINS[name]
    a = plugin.load_diffusion_model(config(name, folder), torch.device("cpu"), torch.float32).state_dict()
    cfg = config(name, folder, diffusion_model=original_path(folder))
    b = plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32).state_dict()
    assert a.keys() == b.keys() and len(a) > 40
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the single file really is NVIDIA's layout (net. prefix, original names, training-only extras)
    keys = set(load_file(str(original_path(folder))))
    native = "net.blocks.block1.blocks.2.block.layer2.weight" if name == "cosmos" else "net.blocks.1.mlp.layer2.weight"
    assert native in keys and "net.pos_embedder.seq" in keys
    assert not any("transformer_blocks" in k for k in keys)
    if name == "cosmos":  # the 1.0 learnable position embedding is random in the tiny model, so it was really read
        assert "net.extra_pos_embedder.pos_emb_t" in keys and a["learnable_pos_embed.pos_emb_t"].abs().sum() > 0


def test_predict2_original_keys_match_diffusers_converter(tiny_predict2: Path) -> None:
    """diffusers converts Predict2 files correctly (its 1.0 branch is unreachable); compare key for key."""
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    original = load_file(str(original_path(tiny_predict2)))
    theirs = convert_cosmos_transformer_checkpoint_to_diffusers(dict(original))
    ours = to_diffusers(original, "predict2")
    assert set(ours) == set(theirs) - {"logvar.1.weight"}
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_original_file_of_the_other_generation_is_refused(tiny_models: dict[str, Path]) -> None:
    cfg = config("cosmos", tiny_models["cosmos"], diffusion_model=original_path(tiny_models["cosmos-predict2"]))
    expected = r"predict2\d*/tiny\.original\.safetensors: this is a Cosmos-Predict2 transformer checkpoint"
    with pytest.raises(KeyError, match=expected):
        cosmos1.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    problems = cosmos1.validate_model_files(cfg)
    assert len(problems) == 1
    assert "not a 'cosmos' model" in problems[0] and 'type = "cosmos-predict2"' in problems[0]


def test_bad_single_file_names_file_and_key(tiny_predict2: Path, tmp_path: Path) -> None:
    bad = load_file(str(original_path(tiny_predict2)))
    bad["net.blocks.0.self_attn.extra.weight"] = torch.zeros(2)
    file = tmp_path / "bad.safetensors"
    save_file(bad, str(file))
    plugin = predict2
    cfg = config("cosmos-predict2", tiny_predict2, diffusion_model=file)
    with pytest.raises(KeyError, match=r"bad\.safetensors: unexpected key 'blocks\.0\.self_attn\.extra\.weight'"):
        plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    del bad["net.blocks.0.self_attn.extra.weight"]
    bad["net.blocks.0.mlp.layer1.weight"] = torch.zeros(3, 3)
    save_file(bad, str(file))
    with pytest.raises(ValueError, match=r"bad\.safetensors: 'transformer_blocks\.0\.ff\.net\.0\.proj\.weight' has"):
        plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)


def test_validate_model_files(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    for name, folder in tiny_models.items():
        assert PLUGINS[name].validate_model_files(config(name, folder)) == []
        assert PLUGINS[name].validate_model_files(config(name, folder, diffusion_model=original_path(folder))) == []
    # a Predict2 folder given to the 1.0 entry point: the pipeline class says so, alone
    problems = cosmos1.validate_model_files(config("cosmos", tiny_models["cosmos-predict2"]))
    assert len(problems) == 1 and "'Cosmos2TextToImagePipeline'" in problems[0]
    assert "'CosmosTextToWorldPipeline'" in problems[0] and "model_index.json" in problems[0]
    # a 1.0 folder whose VAE was swapped for the Wan VAE, and whose transformer weights are gone
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["cosmos"], broken)
    shutil.rmtree(broken / "vae")
    shutil.copytree(tiny_models["cosmos-predict2"] / "vae", broken / "vae")
    problems = cosmos1.validate_model_files(config("cosmos", broken))
    vae_config = broken / "vae" / "config.json"
    assert problems == [f"{vae_config}: the vae is 'AutoencoderKLWan'; expected 'AutoencoderKLCosmos'"]
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    shutil.rmtree(broken / "vae")
    shutil.copytree(tiny_models["cosmos"] / "vae", broken / "vae")
    problems = cosmos1.validate_model_files(config("cosmos", broken))
    assert len(problems) == 1 and "no diffusion_pytorch_model.safetensors" in problems[0]


@pytest.mark.parametrize(
    ("name", "condition_channel", "frames"),
    [("cosmos", False, 3), ("cosmos", False, 1), ("cosmos-predict2", False, 1), ("cosmos-predict2", True, 2)],
)
def test_layers_compute_the_diffusers_forward(name: str, condition_channel: bool, frames: int) -> None:
    """The pipeline layers against the unmodified diffusers forward (run with the torch-only resize installed),
    called the way the reference pipelines call it: fps for videos, a zero padding (and condition) mask."""
    resize.install()
    variant = "1.0" if name == "cosmos" else "predict2"
    model = tiny_transformer(TinyCosmosConfig(variant=variant))
    if condition_channel:  # Predict2 video-to-world: one more input channel for the conditioning mask
        from diffusers import CosmosTransformer3DModel

        model = CosmosTransformer3DModel.from_config({**model.config, "in_channels": 5}).eval()
    plugin = PLUGINS[name]
    cfg = config(name, Path("unused"))
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(2, 4, frames, 4, 6, generator=g), "t5_embeds": torch.randn(2, 16, 16, generator=g)}
    inputs, targets = plugin.prepare_inputs(batch, TrainingContext(cfg), torch.Generator().manual_seed(1))
    x = inputs
    with torch.no_grad():
        for layer in plugin.split_into_layers(model, cfg):
            x = layer(x)
        fps = plugin.default_fps if frames > 1 else None
        kwargs = {"condition_mask": torch.zeros(2, 1, frames, 4, 6)} if condition_channel else {}
        expected = model(
            hidden_states=inputs[0],
            timestep=inputs[1],
            encoder_hidden_states=inputs[2],
            fps=fps,
            padding_mask=torch.zeros(1, 1, 32, 48),
            **kwargs,
        ).sample
    assert len(x) == 1 and x[0].shape == (2, 4, frames, 4, 6) == targets[0].shape
    assert torch.allclose(x[0], expected, atol=1e-5), (x[0] - expected).abs().max()


def test_latents_larger_than_max_size_are_refused_by_name() -> None:
    model = tiny_transformer(TinyCosmosConfig(variant="predict2"))  # max_size (8, 32, 32)
    cfg = config("cosmos-predict2", Path("unused"))
    layers = predict2.split_into_layers(model, cfg)
    inputs = (torch.zeros(1, 4, 1, 40, 8), torch.zeros(1), torch.zeros(1, 16, 16))
    with pytest.raises(ValueError, match=r"latents of 1x40x8 .* exceed the transformer's max_size 8x32x32"):
        layers[0](inputs)


def test_resize_nearest_matches_nearest_interpolation() -> None:
    mask = (torch.rand(1, 1, 32, 48, generator=torch.Generator().manual_seed(0)) > 0.5).float()
    out = resize.resize_nearest(mask, (4, 6))
    assert out.shape == (1, 1, 4, 6) and torch.equal(out, mask[:, :, ::8, ::8])


@pytest.mark.parametrize("name", ["cosmos", "cosmos-predict2"])
def test_encoders_match_the_pipelines(tiny_models: dict[str, Path], name: str, caplog) -> None:
    import diffusers

    folder, plugin = tiny_models[name], PLUGINS[name]
    enc = plugin.load_encoders(config(name, folder), torch.device("cpu"))
    captions = ["a red cat", "a photo of a dog on a tree with a river"]
    text = plugin.encode_batch(enc, EncodeBatch(captions=captions))["t5_embeds"]
    pipeline = diffusers.CosmosTextToWorldPipeline if name == "cosmos" else diffusers.Cosmos2TextToImagePipeline
    fake = type("P", (), {"tokenizer": enc.tokenizer, "text_encoder": enc.text_encoder, "_execution_device": "cpu"})()
    expected = pipeline._get_t5_prompt_embeds(fake, captions, max_sequence_length=16)
    assert text.shape == (2, 16, 16) and torch.equal(text, expected)
    assert text[0, 4:].abs().sum() == 0 and text[0, :4].abs().sum() > 0  # "a red cat </s>", then zeros

    frames = 9 if name == "cosmos" else 5
    pixels = torch.rand(2, 3, frames, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[..., :16] = 1
    with caplog.at_level(logging.WARNING, logger="diffpipe.cosmos"):
        media = plugin.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    assert f"training on {frames} frames at 48x32" in caplog.text
    latents = media["latents"]
    assert latents.shape == (2, 4, 2, 4, 6) and media["mask"].shape == (2, 1, 1, 4, 6)
    assert media["mask"][..., :2].min() == 1 and media["mask"][..., 2:].max() == 0
    # the pipelines' decode step (latents * std / sigma_data + mean) takes the cache back to the VAE's latents
    vae = enc.vae
    raw = vae.encode(pixels).latent_dist.mode()
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, 4, -1, 1, 1)[:, :, :2]
    std = torch.tensor(c.latents_std).view(1, 4, -1, 1, 1)[:, :, :2]
    sigma_data = 0.5 if name == "cosmos" else 1.0
    assert torch.allclose(latents * std / sigma_data + mean, raw, atol=1e-5)
    image = plugin.encode_batch(enc, EncodeBatch(pixels=pixels[:, :, 0]))["latents"]
    assert image.shape == (2, 4, 1, 4, 6)


def test_missing_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for name, plugin in PLUGINS.items():
        with pytest.raises(FileNotFoundError, match=r"empty/transformer/config\.json"):
            plugin.load_diffusion_model(config(name, tmp_path / "empty"), torch.device("cpu"), torch.float32)
        with pytest.raises(FileNotFoundError, match=r"empty/vae"):
            plugin.load_encoders(config(name, tmp_path / "empty"), torch.device("cpu"))
        assert "model_index.json" in plugin.validate_model_files(config(name, tmp_path / "empty"))[0]


def test_model_index_names_the_pipeline(tiny_models: dict[str, Path]) -> None:
    index = json.loads((tiny_models["cosmos"] / "model_index.json").read_text())
    assert index["_class_name"] == "CosmosTextToWorldPipeline" and index["vae"] == ["diffusers", "AutoencoderKLCosmos"]


def test_original_file_is_read_per_stage(tiny_models: dict[str, Path]) -> None:
    """Each of 2 stages reads only its own tensors from NVIDIA's file (once), never the training-only ones."""
    from diffpipe_core.registry import get_registry
    from diffpipe_core.testing.stage_reads import assert_stages_read_their_own

    folder = tiny_models["cosmos"]
    cfg = config("cosmos", folder, diffusion_model=original_path(folder))
    first, second = (set(s.reads) for s in assert_stages_read_their_own(get_registry().model("cosmos"), cfg))
    assert first and second and all(k.startswith("net.") for k in first | second)
    assert "net.blocks.block0.blocks.0.block.attn.to_q.0.weight" in first
    assert "net.final_layer.linear.weight" in second
    assert set(load_file(str(original_path(folder)))) - (first | second) == {
        "net.pos_embedder.seq",
        "net.logvar.1.weight",
    }
