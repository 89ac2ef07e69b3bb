"""OmniGen2 in-process: the text tensors as the reference pipeline computes them (its chat template with its system
turn, Qwen2.5-VL's last hidden state, padded to the longest caption there and to text_max_length here: the real
tokens' states are equal); the latents with FLUX.1's VAE normalisation; the pipeline layers against the transformer's
forward on OmniGen2's time, negated; the training times (the reference's dynamic time shift); per-stage loading; the
default LoRA targets; the ComfyUI-style single file loads the folder's weights; full fine-tune exports."""

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
from diffpipe_omnigen.config import SYSTEM_PROMPT
from diffpipe_omnigen.plugin import plugin as omnigen
from diffpipe_omnigen.testing import comfy_path, tiny_config

CPU = torch.device("cpu")
CAPTIONS = ["a red cat", "a photo of a large dark mountain with a river in the city on a bright sky"]


def pipeline_prompt_embeds(folder: Path, captions: list[str], system: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``OmniGen2Pipeline.encode_prompt`` transcribed: Qwen's chat format (system, user; no generation prompt), the
    tokenizer padding to the longest, ``mllm(...).hidden_states[-1]``."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(folder / "processor"))
    mllm = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder / "mllm")).eval()
    texts = [f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{c}<|im_end|>\n" for c in captions]
    tokens = tok(texts, padding="longest", max_length=256, truncation=True, return_tensors="pt")
    with torch.no_grad():
        states = mllm(tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True).hidden_states
    return states[-1], tokens.attention_mask


@pytest.mark.parametrize("system", [SYSTEM_PROMPT, "You draw."])
def test_text_tensors_equal_the_pipeline_prompt_encoding(tiny_omnigen2: Path, system: str) -> None:
    enc = omnigen.load_encoders(tiny_config(tiny_omnigen2, system_prompt=system), CPU)
    out = omnigen.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))
    expected, mask = pipeline_prompt_embeds(tiny_omnigen2, CAPTIONS, system)
    assert out["text_embeds"].shape == (2, 64, 32) and out["text_mask"].dtype == torch.long
    lengths = mask.sum(dim=1).tolist()
    assert lengths[0] < lengths[1] == expected.shape[1] < 64 and len(system.split()) < lengths[0]
    assert out["text_mask"].sum(dim=1).tolist() == lengths
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out["text_embeds"][i, :n], expected[i, :n], rtol=1e-5, atol=1e-5)


def test_latents_as_the_pipeline_normalises_them(tiny_omnigen2: Path) -> None:
    enc = omnigen.load_encoders(tiny_config(tiny_omnigen2), CPU)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = omnigen.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    vae = enc.vae
    with torch.no_grad():  # OmniGen2Pipeline.encode_vae: (z - shift_factor) * scaling_factor (its mode here)
        expected = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    assert vae.config.shift_factor and media["latents"].shape == (2, 4, 4, 6)
    torch.testing.assert_close(media["latents"], expected, rtol=0, atol=1e-6)
    assert media["mask"].shape == (2, 1, 4, 6) and media["mask"][..., :2, :].min() == 1


@pytest.mark.parametrize("lengths", [(30, 41), (33, 33)], ids=["captions-differ", "captions-equal"])
def test_layers_compute_the_forward_on_omnigen_time(tiny_omnigen2: Path, lengths: tuple) -> None:
    cfg = tiny_config(tiny_omnigen2)
    model = omnigen.load_diffusion_model(cfg, CPU, torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(2, 64, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batch = {"latents": torch.randn(2, 4, 4, 6, generator=g), "text_embeds": torch.randn(2, 64, 32, generator=g),
             "text_mask": mask}
    inputs, targets = omnigen.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t, text, text_mask = inputs
    noise = batch["latents"] + targets[0]  # target = noise - x; x_t = t x + (1 - t) noise in OmniGen2's time
    assert torch.allclose(x_t, t.view(-1, 1, 1, 1) * batch["latents"] + (1 - t.view(-1, 1, 1, 1)) * noise, atol=1e-5)
    out = inputs
    with torch.no_grad():
        for layer in omnigen.split_into_layers(model, cfg):
            out = layer(out)
        expected = model(x_t, t, text, text_mask)  # x - noise
    assert out[0].shape == batch["latents"].shape
    torch.testing.assert_close(out[0], -expected, rtol=1e-5, atol=1e-6)


def test_training_times_are_the_reference_dynamic_shift(tiny_omnigen2: Path) -> None:
    from diffpipe_core.schema import ConfigError

    batch = {"latents": torch.zeros(64, 4, 32, 32), "text_embeds": torch.zeros(64, 8, 32),
             "text_mask": torch.ones(64, 8, dtype=torch.long)}
    times = {}
    for name, keys in {"plain": {"flux_shift": False}, "dynamic": {}}.items():
        cfg = tiny_config(tiny_omnigen2, timestep_sample_method="uniform", **keys)
        (_, times[name], _, _), _ = omnigen.prepare_inputs(batch, TrainingContext(model_config=cfg),
                                                           torch.Generator().manual_seed(3))
    # the reference's Transport.sample: t_data, then time_shift(mu, 1, t) = 1 - e^mu / (e^mu + 1 / (1 - t) - 1)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (16 * 16 - 256)
    t = times["plain"]  # OmniGen2's time of the unshifted draw
    expected = 1 - math.exp(mu) / (math.exp(mu) + (1 / (1 - t) - 1))
    torch.testing.assert_close(times["dynamic"], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises((ConfigError, ValueError), match=r"shift \(3\.0\) needs flux_shift = false"):
        tiny_config(tiny_omnigen2, shift=3.0)


def test_default_lora_targets_are_the_text_to_image_blocks(tiny_omnigen2: Path) -> None:
    targets = omnigen.lora_targets(tiny_config(tiny_omnigen2))
    assert "layers.1.norm1.linear" in targets and "context_refiner.0.attn.to_q" in targets
    assert "context_refiner.0.norm1.linear" not in targets  # an RMSNorm there
    assert not [t for t in targets if t.startswith("ref_image_refiner")]
    assert len(targets) == 8 * 2 + 8 * 1 + 7 * 1  # main blocks, noise refiner, context refiner


def test_the_comfyui_file_loads_the_folder_weights(tiny_omnigen2: Path) -> None:
    folder = omnigen.load_diffusion_model(tiny_config(tiny_omnigen2), CPU, torch.float32).state_dict()
    single = omnigen.load_diffusion_model(tiny_config(tiny_omnigen2, diffusion_model=comfy_path(tiny_omnigen2)), CPU,
                                          torch.float32).state_dict()
    assert folder.keys() == single.keys() and len(folder) > 80
    for key in folder:
        assert torch.equal(folder[key], single[key]), key


def test_bad_single_file_names_file_and_key(tiny_omnigen2: Path, tmp_path: Path) -> None:
    state = load_file(str(comfy_path(tiny_omnigen2)))
    file = tmp_path / "bad.safetensors"
    save_file({k: v for k, v in state.items() if not k.endswith("layers.0.attn.to_out.0.weight")}, str(file))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*not in the file.*layers\.0\.attn\.to_out\.0\.weight"):
        omnigen.load_diffusion_model(tiny_config(tiny_omnigen2, diffusion_model=file), CPU, torch.float32)


@pytest.mark.parametrize("layout", ["folder", "comfyui"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_omnigen2: Path, layout: str) -> None:
    single = {"diffusion_model": comfy_path(tiny_omnigen2)} if layout == "comfyui" else {}
    registry = Registry()
    assert registry.register_model("omnigen2", omnigen).ok
    stages = assert_stages_read_their_own(registry.model("omnigen2"), tiny_config(tiny_omnigen2, **single))
    block = re.compile(r"(?:^|diffusion_model\.)layers\.(\d+)\.")
    mains = [{int(m.group(1)) for k in s.reads if (m := block.search(k))} for s in stages]
    assert 1 in mains[-1] and 1 not in mains[0]


def test_full_model_exports_load_back(tiny_omnigen2: Path, tmp_path: Path) -> None:
    from diffpipe_omnigen.model import OmniGen2Transformer2DModel

    cfg = tiny_config(tiny_omnigen2)
    model = omnigen.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        model.layers[1].attn.to_k.weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(omnigen, model, cfg, saved)
    single = saved / "single_file" / "omnigen2_transformer.safetensors"
    from_single = omnigen.load_diffusion_model(tiny_config(tiny_omnigen2, diffusion_model=single), CPU, torch.float32)
    from_folder = OmniGen2Transformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    assert {k for k in state if k.startswith("ref_image_refiner.")}  # the whole model, references included
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder[key], value), key
