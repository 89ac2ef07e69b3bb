"""AuraFlow against diffusers, in-process: the text tensors against AuraFlowPipeline.encode_prompt; the latents as the
pipeline normalises them; the pipeline layers against AuraFlowTransformer2DModel.forward; both on-disk layouts load
the same weights, the original one as diffusers' own converter reads it; per-stage loading reads only each stage's
tensors; the ComfyUI LoRA and full fine-tune exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_auraflow.original import diffusers_to_original, layout_for_keys
from diffpipe_auraflow.plugin import plugin as aura
from diffpipe_auraflow.testing import TinyAuraFlowConfig, original_path, tiny_config, tiny_transformer
from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.registry import Registry
from diffpipe_core.testing import comfy, runs
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own

CPU = torch.device("cpu")
CAPTIONS = ["a red cat", "a photo of a large dark mountain with a river in the city on a bright sky"]


def test_text_tensors_equal_the_pipeline_encode_prompt(tiny_auraflow: Path) -> None:
    from diffusers import AuraFlowPipeline

    enc = aura.load_encoders(tiny_config(tiny_auraflow), CPU)
    out = aura.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))
    pipe = AuraFlowPipeline.from_pretrained(str(tiny_auraflow), local_files_only=True)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False, device=CPU,
                                                max_sequence_length=16)
    assert out["text_embeds"].shape == (2, 16, 32)
    torch.testing.assert_close(out["text_embeds"], embeds.float(), rtol=0, atol=0)
    n = int(mask[0].reshape(16, 32)[:, 0].sum())  # the short caption's tokens (the mask is per element): its padding
    # zeroed, its tokens not
    assert 2 < n < 16 and out["text_embeds"][0, :n].abs().min() > 0 and not out["text_embeds"][0, n:].any()


def test_latents_as_the_pipeline_normalises_them(tiny_auraflow: Path) -> None:
    enc = aura.load_encoders(tiny_config(tiny_auraflow), CPU)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = aura.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    vae = enc.vae
    with torch.no_grad():  # AuraFlowPipeline decodes latents / scaling_factor: SDXL's VAE has no shift
        expected = vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor
    assert media["latents"].shape == (2, 4, 4, 6)
    torch.testing.assert_close(media["latents"], expected, rtol=0, atol=1e-6)
    assert media["mask"].shape == (2, 1, 4, 6) and media["mask"][..., :2, :].min() == 1


def test_layers_compute_the_diffusers_forward(tiny_auraflow: Path) -> None:
    cfg = tiny_config(tiny_auraflow)
    model = aura.load_diffusion_model(cfg, CPU, torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    batch = {"latents": torch.randn(2, 4, 4, 6, generator=g), "text_embeds": torch.randn(2, 16, 32, generator=g)}
    inputs, targets = aura.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t, text = inputs
    assert torch.allclose(x_t, batch["latents"] + t.view(-1, 1, 1, 1) * targets[0], atol=1e-5)
    out = inputs
    with torch.no_grad():
        for layer in aura.split_into_layers(model, cfg):
            out = layer(out)
        # AuraFlowPipeline: timestep = the scheduler's sigma * 1000 / 1000
        expected = model(hidden_states=x_t, encoder_hidden_states=text, timestep=t).sample
    assert out[0].shape == batch["latents"].shape
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-6)


def test_both_layouts_load_the_same_weights_as_diffusers_converts_them(tiny_auraflow: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_auraflow_transformer_checkpoint_to_diffusers

    folder = aura.load_diffusion_model(tiny_config(tiny_auraflow), CPU, torch.float32).state_dict()
    single = aura.load_diffusion_model(tiny_config(tiny_auraflow, diffusion_model=original_path(tiny_auraflow)), CPU,
                                       torch.float32).state_dict()
    assert folder.keys() == single.keys() and len(folder) > 40
    for key in folder:
        assert torch.equal(folder[key], single[key]), key
    original = load_file(str(original_path(tiny_auraflow)))
    assert {"double_layers.1.attn.w2q.weight", "double_layers.0.mlpC.c_proj.weight", "single_layers.1.modCX.1.weight",
            "positional_encoding", "init_x_linear.bias", "cond_seq_linear.weight", "register_tokens",
            "modF.1.weight"} <= set(original)
    converted = convert_auraflow_transformer_checkpoint_to_diffusers(dict(original))
    assert converted.keys() == folder.keys()
    for key in folder:  # the final adaLN's swapped halves included
        assert torch.equal(converted[key], folder[key]), key


def test_bad_single_file_names_file_and_key(tiny_auraflow: Path, tmp_path: Path) -> None:
    original = load_file(str(original_path(tiny_auraflow)))
    file = tmp_path / "bad.safetensors"
    load = lambda: aura.load_diffusion_model(tiny_config(tiny_auraflow, diffusion_model=file), CPU, torch.float32)  # noqa: E731
    save_file({k: v for k, v in original.items() if k != "double_layers.0.attn.w2q.weight"}, str(file))
    with pytest.raises(KeyError, match=r"bad\.safetensors.*missing key 'double_layers\.0\.attn\.w2q\.weight'"):
        load()
    save_file({**original, "cond_seq_linear.bias": torch.zeros(3)}, str(file))
    with pytest.raises(ValueError, match=r"(?s)bad\.safetensors.*cond_seq_linear\.bias"):
        load()


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_auraflow: Path, layout: str) -> None:
    single = {"diffusion_model": original_path(tiny_auraflow)} if layout == "original" else {}
    registry = Registry()
    assert registry.register_model("auraflow", aura).ok
    stages = assert_stages_read_their_own(registry.model("auraflow"), tiny_config(tiny_auraflow, **single))
    block = re.compile(r"single_(?:transformer_blocks|layers)\.(\d+)\.")
    singles = [{int(m.group(1)) for k in s.reads if (m := block.search(k))} for s in stages]
    assert 1 in singles[-1] and 1 not in singles[0]


def test_comfyui_lora_is_what_comfyuis_key_map_loads_and_applies_like_the_separate_loras(tiny_auraflow: Path) -> None:
    """Every default target under its native name (``diffusion_model.<name>``, which ComfyUI's AuraFlow key map takes
    for every weight of its model; nothing is fused), with ``.alpha``, applied as ComfyUI applies it."""
    targets = aura.lora_targets(tiny_config(tiny_auraflow))
    model = runs.with_random_lora(tiny_transformer(TinyAuraFlowConfig()), targets, 4)
    state = lora_state_dict(model)
    file = aura.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    stems = set(comfy.group_by_stem(file))
    assert {"diffusion_model.double_layers.1.attn.w1o", "diffusion_model.double_layers.0.mlpX.c_proj",
            "diffusion_model.single_layers.1.attn.w1q", "diffusion_model.single_layers.0.mlp.c_fc2"} <= stems
    assert len(stems) == len({k for k in state if k.endswith(".lora_A.weight")})  # one native module each
    assert float(file["diffusion_model.double_layers.0.attn.w2q.alpha"]) == 6.0
    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    native = diffusers_to_original(base)
    applied = comfy.apply_file({f"diffusion_model.{k}": v for k, v in native.items()}, file,
                               comfy.generic_key_map(native))
    got = layout_for_keys(base).to_model({k.removeprefix("diffusion_model."): v for k, v in applied.items()})
    runs.assert_state_close(got, runs.merge_peft(base, state, 6.0 / 4), atol=1e-5)
    # LoKr/LoHa stems: ComfyUI's AuraFlow key map takes the diffusers names under transformer.
    assert aura.adapter_key_names(modules=["single_transformer_blocks.0.attn.to_q"], format="comfyui") == {
        "single_transformer_blocks.0.attn.to_q": "transformer.single_transformer_blocks.0.attn.to_q"
    }


def test_full_model_exports_load_back(tiny_auraflow: Path, tmp_path: Path) -> None:
    from diffusers import AuraFlowTransformer2DModel

    cfg = tiny_config(tiny_auraflow)
    model = aura.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        model.single_transformer_blocks[1].ff.linear_1.weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(aura, model, cfg, saved)
    single = saved / "single_file" / "auraflow_transformer.safetensors"
    from_single = aura.load_diffusion_model(tiny_config(tiny_auraflow, diffusion_model=single), CPU, torch.float32)
    from_folder = AuraFlowTransformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder[key], value), key
