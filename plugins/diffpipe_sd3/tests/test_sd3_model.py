"""SD3 against diffusers, in-process: the text tensors against StableDiffusion3Pipeline.encode_prompt (with T5, and
without it as the pipeline allows); the latents as the pipeline normalises them; the pipeline layers against
SD3Transformer2DModel.forward; both on-disk layouts load the same weights, Stability's as diffusers' own converter
reads it; per-stage loading reads only each stage's tensors; the ComfyUI LoRA and full fine-tune exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.registry import Registry
from diffpipe_core.testing import comfy, runs
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_sd3.original import layout_for_config
from diffpipe_sd3.plugin import plugin as sd3
from diffpipe_sd3.testing import PREFIX, TinySD3Config, original_path, tiny_config, tiny_transformer

CPU = torch.device("cpu")
CAPTIONS = ["a red cat", "a photo of a large dark mountain with a river in the city on a bright sky"]


@pytest.mark.parametrize("t5", [True, False])
def test_text_tensors_equal_the_pipeline_encode_prompt(tiny_sd3: Path, t5: bool) -> None:
    from diffusers import StableDiffusion3Pipeline

    enc = sd3.load_encoders(tiny_config(tiny_sd3, t5=t5), CPU)
    assert (getattr(enc, "text_encoder_3", None) is not None) == t5  # T5 is not even loaded without it
    out = sd3.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))
    drop = {} if t5 else {"text_encoder_3": None, "tokenizer_3": None}
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3), local_files_only=True, **drop)
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(list(CAPTIONS), None, None, device=CPU,
                                                  do_classifier_free_guidance=False, max_sequence_length=16)
    assert out["text_embeds"].shape == (2, 77 + 16, 64) and out["pooled"].shape == (2, 48)
    torch.testing.assert_close(out["text_embeds"], embeds.float(), rtol=0, atol=0)
    torch.testing.assert_close(out["pooled"], pooled.float(), rtol=0, atol=0)
    assert out["text_embeds"][:, 77:].any() == t5  # T5's tokens, or the pipeline's zeros in their place
    # CLIP's penultimate hidden state, not its last
    ids = pipe.tokenizer(CAPTIONS[:1], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        last = pipe.text_encoder(ids, output_hidden_states=True).last_hidden_state[0]
    assert not torch.allclose(last, embeds[0, :77, :16], atol=1e-3)


def test_latents_as_the_pipeline_normalises_them(tiny_sd3: Path) -> None:
    enc = sd3.load_encoders(tiny_config(tiny_sd3), CPU)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = sd3.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    vae = enc.vae
    with torch.no_grad():  # StableDiffusion3Img2ImgPipeline.prepare_latents, with the posterior's mode
        expected = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    assert vae.config.shift_factor and media["latents"].shape == (2, 4, 4, 6)
    torch.testing.assert_close(media["latents"], expected, rtol=0, atol=1e-6)
    assert media["mask"].shape == (2, 1, 4, 6) and media["mask"][..., :2, :].min() == 1


def test_layers_compute_the_diffusers_forward(tiny_sd3: Path) -> None:
    cfg = tiny_config(tiny_sd3)
    model = sd3.load_diffusion_model(cfg, CPU, torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    batch = {"latents": torch.randn(2, 4, 4, 6, generator=g), "text_embeds": torch.randn(2, 93, 64, generator=g),
             "pooled": torch.randn(2, 48, generator=g)}
    inputs, targets = sd3.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t, text, pooled = inputs
    assert torch.allclose(x_t, batch["latents"] + t.view(-1, 1, 1, 1) * targets[0], atol=1e-5)
    out = inputs
    with torch.no_grad():
        for layer in sd3.split_into_layers(model, cfg):
            out = layer(out)
        # StableDiffusion3Pipeline: timestep = the scheduler's sigma * 1000
        expected = model(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=text,
                         pooled_projections=pooled).sample
    assert out[0].shape == batch["latents"].shape
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-6)


def test_both_layouts_load_the_same_weights_as_diffusers_converts_them(tiny_sd3: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    folder = sd3.load_diffusion_model(tiny_config(tiny_sd3), CPU, torch.float32).state_dict()
    single = sd3.load_diffusion_model(tiny_config(tiny_sd3, diffusion_model=original_path(tiny_sd3)), CPU,
                                      torch.float32).state_dict()
    assert folder.keys() == single.keys() and len(folder) > 50
    for key in folder:
        assert torch.equal(folder[key], single[key]), key
    original = load_file(str(original_path(tiny_sd3)))
    names = ("joint_blocks.1.x_block.attn.qkv.weight", "joint_blocks.0.x_block.attn2.qkv.bias", "pos_embed",
             "joint_blocks.0.context_block.attn.ln_q.weight", "x_embedder.proj.weight",
             "final_layer.adaLN_modulation.1.bias", "y_embedder.mlp.2.weight")
    assert {PREFIX + k for k in names} <= set(original)
    assert not any(".context_block.mlp." in k or ".context_block.attn.proj" in k for k in original if "blocks.1." in k)
    converted = convert_sd3_transformer_checkpoint_to_diffusers(dict(original))
    assert converted.keys() == folder.keys()
    for key in folder:  # the swapped adaLN halves of the final layer and the last block's context side included
        assert torch.equal(converted[key], folder[key]), key


def test_bad_single_file_names_file_and_key(tiny_sd3: Path, tmp_path: Path) -> None:
    original = load_file(str(original_path(tiny_sd3)))
    file = tmp_path / "bad.safetensors"
    load = lambda: sd3.load_diffusion_model(tiny_config(tiny_sd3, diffusion_model=file), CPU, torch.float32)  # noqa: E731
    missing = f"{PREFIX}joint_blocks.0.x_block.attn.qkv.weight"
    save_file({k: v for k, v in original.items() if k != missing}, str(file))
    with pytest.raises(KeyError, match=r"bad\.safetensors.*missing key 'joint_blocks\.0\.x_block\.attn\.qkv\.weight'"):
        load()
    save_file({**original, f"{PREFIX}x_embedder.norm.weight": torch.zeros(3)}, str(file))
    with pytest.raises(ValueError, match=r"(?s)bad\.safetensors.*x_embedder\.norm\.weight"):
        load()


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_sd3: Path, layout: str) -> None:
    single = {"diffusion_model": original_path(tiny_sd3)} if layout == "original" else {}
    registry = Registry()
    assert registry.register_model("sd3", sd3).ok
    stages = assert_stages_read_their_own(registry.model("sd3"), tiny_config(tiny_sd3, **single))
    blocks = [{int(m.group(1)) for k in s.reads if (m := re.search(r"(?:transformer|joint)_blocks\.(\d+)\.", k))}
              for s in stages]
    assert 1 in blocks[-1] and 1 not in blocks[0]
    assert any(k.endswith("pos_embed") for k in stages[0].reads)  # the position table: the first stage's alone


def test_comfyui_lora_is_what_comfyuis_key_map_loads_and_applies_like_the_separate_loras(tiny_sd3: Path) -> None:
    """Every default target, fused where Stability's MMDiT fuses (q/k/v), under ComfyUI's names for the model (the
    native keys ``diffusion_model.<name>``: ComfyUI's MMDiT is Stability's), applied as ComfyUI applies it."""
    targets = sd3.lora_targets(tiny_config(tiny_sd3))
    model = runs.with_random_lora(tiny_transformer(TinySD3Config()), targets, 4)
    state = lora_state_dict(model)
    adapted = {k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")}
    assert {"transformer_blocks.0.attn2.to_q", "transformer_blocks.0.attn.add_q_proj", "transformer_blocks.1.ff.net.2",
            "transformer_blocks.0.ff_context.net.2"} <= adapted
    assert "transformer_blocks.1.attn.add_q_proj" not in adapted  # the last block's text queries feed nothing
    file = sd3.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    assert file["diffusion_model.joint_blocks.0.x_block.attn.qkv.lora_A.weight"].shape == (12, 32)
    assert float(file["diffusion_model.joint_blocks.0.x_block.attn.qkv.alpha"]) == 18.0
    assert float(file["diffusion_model.joint_blocks.1.context_block.attn.qkv.alpha"]) == 12.0  # k and v only
    assert float(file["diffusion_model.joint_blocks.0.x_block.mlp.fc2.alpha"]) == 6.0

    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    config = dict(model.config)
    native = layout_for_config(config).to_original(base)
    key_map = comfy.generic_key_map(native)  # ComfyUI's model_lora_keys_unet on its MMDiT's state dict
    applied = comfy.apply_file({f"diffusion_model.{k}": v for k, v in native.items()}, file, key_map)
    got = layout_for_config(config).to_model(applied)  # a read prefix of the layout: diffusion_model.
    runs.assert_state_close(got, runs.merge_peft(base, state, 6.0 / 4), atol=1e-5)


def test_full_model_exports_load_back(tiny_sd3: Path, tmp_path: Path) -> None:
    from diffusers import SD3Transformer2DModel

    cfg = tiny_config(tiny_sd3)
    model = sd3.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        model.transformer_blocks[1].ff.net[2].weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(sd3, model, cfg, saved)
    single = saved / "single_file" / "sd3_transformer.safetensors"
    from_single = sd3.load_diffusion_model(tiny_config(tiny_sd3, diffusion_model=single), CPU, torch.float32)
    from_folder = SD3Transformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder[key], value), key


def test_the_block_count_is_read_from_the_file(tiny_sd3: Path, tmp_path: Path) -> None:
    """A file of 3 joint blocks beside the 2-block folder (SD3.5 Large's 38 beside a Medium folder's 24) builds and
    loads as itself, and validate says where the count came from."""
    from diffpipe_sd3.testing import write_tiny_sd3

    deeper = write_tiny_sd3(tmp_path / "three", TinySD3Config(num_layers=3, dual_attention_layers=(0,)))
    cfg = tiny_config(tiny_sd3, diffusion_model=original_path(deeper))
    model = sd3.load_diffusion_model(cfg, CPU, torch.float32)
    assert len(model.transformer_blocks) == 3 and model.transformer_blocks[2].context_pre_only
    assert "num_layers = 3 from the file's tensors (the config says 2)" in sd3.model_file_lines(cfg)[0]
