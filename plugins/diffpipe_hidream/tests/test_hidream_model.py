"""HiDream-I1 against diffusers, in-process: the text tensors against HiDreamImagePipeline.encode_prompt (CLIP-L,
CLIP-G, T5, the Llama hidden-layer stack); the latents as the pipeline normalises them; the pipeline layers against
HiDreamImageTransformer2DModel.forward (square latents, and non-square ones the model pads to its max_seq); the
training shift is the folder scheduler's; the ComfyUI file loads the same weights; per-stage loading reads only each
stage's tensors (MoE blocks split like any block); the default LoRA targets; the ComfyUI LoRA and full fine-tune
exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.registry import Registry
from diffpipe_core.testing import comfy, runs
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_hidream.plugin import plugin as hidream
from diffpipe_hidream.testing import TinyHiDreamConfig, comfy_path, tiny_config, tiny_transformer

CPU = torch.device("cpu")
CAPTIONS = ["a red cat", "a photo of a large dark mountain with a river in the city on a bright sky"]


@pytest.fixture(scope="module")
def encoded(tiny_hidream: Path) -> tuple:
    enc = hidream.load_encoders(tiny_config(tiny_hidream), CPU)
    return enc, hidream.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))


def test_text_tensors_equal_the_pipeline_encode_prompt(tiny_hidream: Path, encoded: tuple) -> None:
    from diffusers import HiDreamImagePipeline

    _, out = encoded
    pipe = HiDreamImagePipeline.from_pretrained(str(tiny_hidream), local_files_only=True)
    with torch.no_grad():
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(list(CAPTIONS), device=CPU, do_classifier_free_guidance=False,
                                                        max_sequence_length=16)
    assert out["t5_embeds"].shape == (2, 16, 32) and out["pooled"].shape == (2, 48)
    assert out["llama_embeds"].shape == (2, 3, 16, 24)  # every Llama layer (3), the padding included
    torch.testing.assert_close(out["t5_embeds"], t5.float(), rtol=0, atol=0)
    torch.testing.assert_close(out["llama_embeds"], llama.transpose(0, 1).float(), rtol=0, atol=0)
    torch.testing.assert_close(out["pooled"], pooled.float(), rtol=0, atol=0)
    # the hidden states after each Llama layer (not its embeddings), and CLIP's projected pooled vectors
    ids = pipe.tokenizer_4(CAPTIONS[:1], padding="max_length", max_length=16, return_tensors="pt")
    with torch.no_grad():
        states = pipe.text_encoder_4(ids.input_ids, attention_mask=ids.attention_mask, output_hidden_states=True)
    torch.testing.assert_close(out["llama_embeds"][0], torch.stack(states.hidden_states[1:])[:, 0])
    assert not torch.allclose(out["llama_embeds"][0, 0], states.hidden_states[0][0])


def test_latents_as_the_pipeline_normalises_them(tiny_hidream: Path, encoded: tuple) -> None:
    enc, _ = encoded
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = hidream.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    vae = enc.vae
    with torch.no_grad():  # the inverse of HiDreamImagePipeline's decoding, with the posterior's mode
        expected = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    assert vae.config.shift_factor and media["latents"].shape == (2, 4, 4, 6)
    torch.testing.assert_close(media["latents"], expected, rtol=0, atol=1e-6)
    assert media["mask"].shape == (2, 1, 4, 6) and media["mask"][..., :2, :].min() == 1


@pytest.mark.parametrize("width", [4, 6])  # square latents, and non-square ones the model pads to max_seq (16)
def test_layers_compute_the_diffusers_forward(tiny_hidream: Path, encoded: tuple, width: int) -> None:
    cfg = tiny_config(tiny_hidream)
    model = hidream.load_diffusion_model(cfg, CPU, torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    batch = {"latents": torch.randn(2, 4, 4, width, generator=g), **encoded[1]}
    inputs, targets = hidream.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t, t5, llama, pooled = inputs
    assert torch.allclose(x_t, batch["latents"] + t.view(-1, 1, 1, 1) * targets[0], atol=1e-5)
    out = inputs
    with torch.no_grad():
        for layer in hidream.split_into_layers(model, cfg):
            out = layer(out)
        # HiDreamImagePipeline: timesteps = the scheduler's sigma * 1000, and it steps with the output negated
        expected = -model(hidden_states=x_t, timesteps=t * 1000, encoder_hidden_states_t5=t5,
                          encoder_hidden_states_llama3=llama.transpose(0, 1), pooled_embeds=pooled).sample
    assert out[0].shape == batch["latents"].shape
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-6)


def test_training_shift_is_the_folder_schedulers(tiny_hidream: Path, tmp_path: Path) -> None:
    """Full and Fast ship shift 3, Dev 6 (FlowMatchEulerDiscreteScheduler's ``shift``); a UniPC flow scheduler's is its
    ``flow_shift``; ``[model] shift`` overrides either."""
    import shutil

    assert hidream.training_shift(tiny_config(tiny_hidream)) == 3.0
    assert hidream.training_shift(tiny_config(tiny_hidream, shift=1.5)) == 1.5
    for config, want in (({"shift": 6.0}, 6.0), ({"use_flow_sigmas": True, "flow_shift": 4.0, "shift": 1.0}, 4.0)):
        folder = tmp_path / str(want)
        shutil.copytree(tiny_hidream / "scheduler", folder / "scheduler")
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
        assert hidream.training_shift(tiny_config(tiny_hidream).model_copy(update={"path": folder})) == want


def test_the_comfyui_file_loads_the_folders_weights(tiny_hidream: Path) -> None:
    from safetensors.torch import load_file

    keys = load_file(str(comfy_path(tiny_hidream)))
    assert "model.diffusion_model.caption_projection.0.linear.weight" in keys  # ComfyUI's model detection key
    assert "model.diffusion_model.double_stream_blocks.0.block.ff_i.experts.3.w2.weight" in keys
    folder = hidream.load_diffusion_model(tiny_config(tiny_hidream), CPU, torch.float32).state_dict()
    single = hidream.load_diffusion_model(tiny_config(tiny_hidream, diffusion_model=comfy_path(tiny_hidream)), CPU,
                                          torch.float32).state_dict()
    assert folder.keys() == single.keys() and len(folder) > 100
    assert all(torch.equal(folder[k], single[k]) for k in folder)


@pytest.mark.parametrize("layout", ["diffusers", "comfyui"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_hidream: Path, layout: str) -> None:
    single = {"diffusion_model": comfy_path(tiny_hidream)} if layout == "comfyui" else {}
    registry = Registry()
    assert registry.register_model("hidream", hidream).ok
    stages = assert_stages_read_their_own(registry.model("hidream"), tiny_config(tiny_hidream, **single))
    blocks = [{m.group(0) for k in s.reads if (m := re.search(r"(double|single)_stream_blocks\.\d+\.", k))}
              for s in stages]
    assert "single_stream_blocks.1." in blocks[-1] and "single_stream_blocks.1." not in blocks[0]
    # a block's experts and router load with it; the caption projections with the layers reading them
    assert any("single_stream_blocks.1.block.ff_i.gate.weight" in k for k in stages[-1].reads)
    assert any("caption_projection.0." in k for k in stages[0].reads)


def test_default_lora_targets_cover_attention_and_every_expert(tiny_hidream: Path) -> None:
    targets = hidream.lora_targets(tiny_config(tiny_hidream))
    model = runs.with_random_lora(tiny_transformer(TinyHiDreamConfig()), targets, 4)
    adapted = {k[: -len(".lora_A.weight")] for k in lora_state_dict(model) if k.endswith(".lora_A.weight")}
    for name in ("double_stream_blocks.1.block.attn1.to_k_t", "double_stream_blocks.0.block.ff_i.experts.3.w3",
                 "double_stream_blocks.0.block.ff_i.shared_experts.w1", "double_stream_blocks.1.block.ff_t.w2",
                 "single_stream_blocks.1.block.attn1.to_out", "single_stream_blocks.0.block.ff_i.experts.0.w2"):
        assert name in adapted, name
    assert not any("caption_projection" in m or "embedder" in m or "final_layer" in m for m in adapted)


def test_comfyui_lora_is_what_comfyuis_key_map_loads_and_applies_like_the_separate_loras(tiny_hidream: Path) -> None:
    """Every default target under ``diffusion_model.<module>`` (ComfyUI's HiDream is diffusers' module tree), with
    ``.alpha``; applied as ComfyUI applies it, the weights are peft's merged ones."""
    targets = hidream.lora_targets(tiny_config(tiny_hidream))
    model = runs.with_random_lora(tiny_transformer(TinyHiDreamConfig()), targets, 4)
    state = lora_state_dict(model)
    file = hidream.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    stem = "diffusion_model.single_stream_blocks.0.block.ff_i.experts.2.w1"
    assert file[f"{stem}.lora_A.weight"].shape == (4, 32) and float(file[f"{stem}.alpha"]) == 6.0
    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    key_map = comfy.generic_key_map(base)  # ComfyUI's model_lora_keys_unet on its HiDream's state dict
    assert set(comfy.group_by_stem(file)) <= set(key_map)
    applied = comfy.apply_file({f"diffusion_model.{k}": v for k, v in base.items()}, file, key_map)
    got = {k.removeprefix("diffusion_model."): v for k, v in applied.items()}
    runs.assert_state_close(got, runs.merge_peft(base, state, 6.0 / 4), atol=1e-5)


def test_full_model_exports_load_back(tiny_hidream: Path, tmp_path: Path) -> None:
    from diffusers import HiDreamImageTransformer2DModel

    cfg = tiny_config(tiny_hidream)
    model = hidream.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        model.single_stream_blocks[1].block.ff_i.experts[0].w2.weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(hidream, model, cfg, saved)
    single = saved / "single_file" / "hidream_transformer.safetensors"
    from_single = hidream.load_diffusion_model(tiny_config(tiny_hidream, diffusion_model=single), CPU, torch.float32)
    from_folder = HiDreamImageTransformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder[key], value), key


def test_llama_4bit_quantizes_the_llama_for_caching(tiny_hidream: Path, encoded: tuple) -> None:
    """``llama_4bit``: Llama's linears are bitsandbytes nf4 (diffusion-pipe's ``llama3_4bit``); its hidden states are
    close to the full encoder's but not equal; the other encoders are untouched."""
    import bitsandbytes as bnb

    enc = hidream.load_encoders(tiny_config(tiny_hidream, llama_4bit=True), CPU)
    assert isinstance(enc.text_encoder_4.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    out = hidream.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))
    full = encoded[1]
    assert torch.equal(out["t5_embeds"], full["t5_embeds"]) and torch.equal(out["pooled"], full["pooled"])
    gap = (out["llama_embeds"] - full["llama_embeds"]).abs().max()
    assert 0 < gap < 0.25 * full["llama_embeds"].abs().max(), gap
