"""Lumina 2 against diffusers, in-process: the text tensors against Lumina2Pipeline.encode_prompt (its system prompt
before each caption, none before the negative prompt); the latents as the pipeline normalises them (Flux's VAE
scaling and shift); the pipeline layers against Lumina2Transformer2DModel.forward on its reversed time, negated;
the training times with lumina_shift; both on-disk layouts load the same weights, the original one as diffusers' own
converter names it; per-stage loading reads only each stage's tensors; LoKr names for ComfyUI; full fine-tune
exports."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.registry import Registry
from diffpipe_core.testing import runs
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_lumina.config import SYSTEM_PROMPT
from diffpipe_lumina.plugin import plugin as lumina
from diffpipe_lumina.testing import original_path, tiny_config

CPU = torch.device("cpu")
CAPTIONS = ["a red cat", "a photo of a large dark mountain with a river in the city on a bright sky"]


def test_text_tensors_equal_the_pipeline_encode_prompt(tiny_lumina2: Path) -> None:
    from diffusers import Lumina2Pipeline

    pipe = Lumina2Pipeline.from_pretrained(str(tiny_lumina2), local_files_only=True)
    for system in (SYSTEM_PROMPT, "You draw."):
        enc = lumina.load_encoders(tiny_config(tiny_lumina2, system_prompt=system), CPU)
        out = lumina.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))
        negative = lumina.encode_batch(enc, EncodeBatch(captions=["blurry"], negative_prompt=True))
        with torch.no_grad():
            embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
                list(CAPTIONS), negative_prompt=["blurry"] * 2, device=CPU, max_sequence_length=48,
                system_prompt=None if system == SYSTEM_PROMPT else system,
            )
        assert out["text_embeds"].shape == (2, 48, 32) and out["text_mask"].dtype == torch.long
        torch.testing.assert_close(out["text_embeds"], embeds.float(), rtol=0, atol=0)
        assert torch.equal(out["text_mask"], mask.long())
        torch.testing.assert_close(negative["text_embeds"], neg_embeds[:1].float(), rtol=0, atol=0)
        assert torch.equal(negative["text_mask"], neg_mask[:1].long())
        words = len(system.split())
        assert words < int(mask[0].sum()) < int(mask[1].sum()) <= 48


def test_latents_as_the_pipeline_normalises_them(tiny_lumina2: Path) -> None:
    enc = lumina.load_encoders(tiny_config(tiny_lumina2), CPU)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = lumina.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    vae = enc.vae
    with torch.no_grad():  # Lumina2Pipeline decodes latents / scaling_factor + shift_factor
        expected = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    assert vae.config.shift_factor and media["latents"].shape == (2, 4, 4, 6)
    torch.testing.assert_close(media["latents"], expected, rtol=0, atol=1e-6)
    assert media["mask"].shape == (2, 1, 4, 6) and media["mask"][..., :2, :].min() == 1


@pytest.mark.parametrize("lengths", [(30, 41), (33, 33)], ids=["captions-differ", "captions-equal"])
def test_layers_compute_the_diffusers_forward_on_the_reversed_time(tiny_lumina2: Path, lengths: tuple) -> None:
    cfg = tiny_config(tiny_lumina2)
    model = lumina.load_diffusion_model(cfg, CPU, torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(2, 48, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batch = {"latents": torch.randn(2, 4, 4, 6, generator=g), "text_embeds": torch.randn(2, 48, 32, generator=g),
             "text_mask": mask}
    inputs, targets = lumina.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t, text, text_mask = inputs
    noise = batch["latents"] + targets[0]  # target = noise - x, x_t = (1 - t) x + t noise
    assert torch.allclose(x_t, (1 - t.view(-1, 1, 1, 1)) * batch["latents"] + t.view(-1, 1, 1, 1) * noise, atol=1e-5)
    out = inputs
    with torch.no_grad():
        for layer in lumina.split_into_layers(model, cfg):
            out = layer(out)
        # the transformer runs on 1 - t (0 = noise) and predicts x - noise, which Lumina2Pipeline negates
        expected = model(hidden_states=x_t, timestep=1 - t, encoder_hidden_states=text,
                         encoder_attention_mask=text_mask).sample
    assert out[0].shape == batch["latents"].shape
    torch.testing.assert_close(out[0], -expected, rtol=1e-5, atol=1e-6)


def test_lumina_shift_is_the_resolution_shift_and_excludes_shift(tiny_lumina2: Path) -> None:
    from diffpipe_core.schema import ConfigError

    batch = {"latents": torch.zeros(64, 4, 32, 32), "text_embeds": torch.zeros(64, 48, 32),
             "text_mask": torch.ones(64, 48, dtype=torch.long)}
    times = {}
    for name, keys in {"plain": {}, "lumina": {"lumina_shift": True}}.items():
        cfg = tiny_config(tiny_lumina2, timestep_sample_method="uniform", **keys)
        (_, times[name], _, _), _ = lumina.prepare_inputs(batch, TrainingContext(model_config=cfg),
                                                          torch.Generator().manual_seed(3))
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (16 * 16 - 256)  # diffusion-pipe: lin((h // 2) * (w // 2)), 256 patches
    t = times["plain"]
    torch.testing.assert_close(times["lumina"], math.exp(mu) / (math.exp(mu) + (1 / t - 1)), rtol=1e-5, atol=1e-6)
    with pytest.raises((ConfigError, ValueError), match=r"shift \(3\.0\) and lumina_shift"):
        tiny_config(tiny_lumina2, shift=3.0, lumina_shift=True)


def test_both_layouts_load_the_same_weights_as_diffusers_names_them(tiny_lumina2: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    folder = lumina.load_diffusion_model(tiny_config(tiny_lumina2), CPU, torch.float32).state_dict()
    single = lumina.load_diffusion_model(tiny_config(tiny_lumina2, diffusion_model=original_path(tiny_lumina2)), CPU,
                                         torch.float32).state_dict()
    assert folder.keys() == single.keys() and len(folder) > 80
    for key in folder:
        assert torch.equal(folder[key], single[key]), key
    original = load_file(str(original_path(tiny_lumina2)))
    assert {"layers.1.attention.qkv.weight", "context_refiner.0.attention_norm1.weight", "cap_embedder.1.weight",
            "noise_refiner.1.adaLN_modulation.1.bias", "final_layer.adaLN_modulation.1.weight", "x_embedder.weight",
            "layers.0.feed_forward.w3.weight", "t_embedder.mlp.2.bias"} <= set(original)
    assert original["layers.0.attention.qkv.weight"].shape == (32 + 16 + 16, 32)  # 2 query heads, 1 key/value head
    # diffusers' converter splits qkv at the 2B release's widths only: every other key is named as it names it
    others = {k: v for k, v in original.items() if ".qkv." not in k}
    converted = convert_lumina2_to_diffusers({**others, "norm_final.weight": torch.zeros(32)})
    assert converted.keys() == {k for k in folder if not re.search(r"\.attn\.to_[qkv]\.", k)}
    for key, value in converted.items():
        assert torch.equal(value, folder[key]), key


def test_bad_single_file_names_file_and_key(tiny_lumina2: Path, tmp_path: Path) -> None:
    original = load_file(str(original_path(tiny_lumina2)))
    file = tmp_path / "bad.safetensors"
    load = lambda: lumina.load_diffusion_model(tiny_config(tiny_lumina2, diffusion_model=file), CPU, torch.float32)  # noqa: E731
    save_file({k: v for k, v in original.items() if k != "layers.0.attention.out.weight"}, str(file))
    with pytest.raises(KeyError, match=r"bad\.safetensors.*missing key 'layers\.0\.attention\.out\.weight'"):
        load()
    save_file({**original, "cap_embedder.1.extra": torch.zeros(3)}, str(file))
    with pytest.raises(ValueError, match=r"(?s)bad\.safetensors.*cap_embedder\.1\.extra"):
        load()


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_lumina2: Path, layout: str) -> None:
    single = {"diffusion_model": original_path(tiny_lumina2)} if layout == "original" else {}
    registry = Registry()
    assert registry.register_model("lumina2", lumina).ok
    stages = assert_stages_read_their_own(registry.model("lumina2"), tiny_config(tiny_lumina2, **single))
    block = re.compile(r"^layers\.(\d+)\.")
    mains = [{int(m.group(1)) for k in s.reads if (m := block.search(k))} for s in stages]
    assert 1 in mains[-1] and 1 not in mains[0]


def test_lokr_names_for_comfyui_and_what_cannot_have_one(tiny_lumina2: Path) -> None:
    names = lumina.adapter_key_names(modules=["layers.0.attn.to_out.0", "noise_refiner.1.norm1.linear"],
                                     format="comfyui")
    assert names == {"layers.0.attn.to_out.0": "diffusion_model.layers.0.attention.out",
                     "noise_refiner.1.norm1.linear": "diffusion_model.noise_refiner.1.adaLN_modulation.1"}
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.to_q"):  # only the fused qkv has a ComfyUI name
        lumina.adapter_key_names(modules=["layers.0.attn.to_q"], format="comfyui")


def test_full_model_exports_load_back(tiny_lumina2: Path, tmp_path: Path) -> None:
    from diffusers import Lumina2Transformer2DModel

    cfg = tiny_config(tiny_lumina2)
    model = lumina.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        model.layers[1].attn.to_k.weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(lumina, model, cfg, saved)
    single = saved / "single_file" / "lumina2_transformer.safetensors"
    from_single = lumina.load_diffusion_model(tiny_config(tiny_lumina2, diffusion_model=single), CPU, torch.float32)
    from_folder = Lumina2Transformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder[key], value), key
