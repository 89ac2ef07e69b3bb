"""Z-Image against diffusers, in-process: the text tensors against ZImagePipeline.encode_prompt (Qwen3 chat template,
penultimate hidden layer, real tokens only); the latents as the pipeline normalises them; the pipeline layers against
ZImageTransformer2DModel.forward (captions of different lengths); both on-disk layouts load the same weights, the
original one as diffusers' own converter reads it; per-stage loading reads only each stage's tensors; exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.registry import Registry
from diffpipe_core.testing import runs
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_zimage.original import diffusers_to_original, original_to_diffusers
from diffpipe_zimage.plugin import plugin as zi
from diffpipe_zimage.testing import TinyZImageConfig, apply_comfyui_lora, original_path, tiny_config, tiny_transformer

CPU = torch.device("cpu")
CAPTIONS = ["a red cat", "a photo of a large dark mountain with a river in the city on a bright sky"]


def test_text_tensors_equal_the_pipeline_encode_prompt(tiny_zimage: Path) -> None:
    from diffusers import ZImagePipeline

    enc = zi.load_encoders(tiny_config(tiny_zimage), CPU)
    out = zi.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))
    pipe = ZImagePipeline.from_pretrained(str(tiny_zimage), local_files_only=True)
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(list(CAPTIONS), device=CPU, do_classifier_free_guidance=False,
                                         max_sequence_length=40)
    assert out["text_embeds"].shape == (2, 40, 32) and out["text_mask"].shape == (2, 40)
    for i, want in enumerate(expected):
        n = want.shape[0]
        assert int(out["text_mask"][i].sum()) == n and bool(out["text_mask"][i, :n].all())
        torch.testing.assert_close(out["text_embeds"][i, :n], want.float(), rtol=0, atol=0)
        assert not out["text_embeds"][i, n:].any()
    # the chat template is really applied: more tokens than the caption alone, the longer caption is longer
    bare = len(pipe.tokenizer(CAPTIONS[0]).input_ids)
    assert expected[0].shape[0] > bare + 4 and expected[1].shape[0] > expected[0].shape[0]
    # the penultimate hidden state, not the last
    ids = pipe.tokenizer(pipe.tokenizer.apply_chat_template([{"role": "user", "content": CAPTIONS[0]}], tokenize=False,
                                                            add_generation_prompt=True), return_tensors="pt")
    with torch.no_grad():
        last = pipe.text_encoder(**ids).last_hidden_state[0]
    assert not torch.allclose(last, expected[0], atol=1e-3)


def test_latents_as_the_pipeline_normalises_them(tiny_zimage: Path) -> None:
    enc = zi.load_encoders(tiny_config(tiny_zimage), CPU)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = zi.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    vae = enc.vae
    with torch.no_grad():  # ZImageImg2ImgPipeline.prepare_latents, with the posterior's mode
        expected = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    assert media["latents"].shape == (2, 4, 4, 6)
    torch.testing.assert_close(media["latents"], expected, rtol=0, atol=1e-6)
    assert media["mask"].shape == (2, 1, 4, 6) and media["mask"][..., :2, :].min() == 1


@pytest.mark.parametrize("lengths", [(5, 37), (9,)])
def test_layers_compute_the_diffusers_forward(tiny_zimage: Path, lengths: tuple[int, ...]) -> None:
    cfg = tiny_config(tiny_zimage)
    model = zi.load_diffusion_model(cfg, CPU, torch.float32).eval()
    b, g = len(lengths), torch.Generator().manual_seed(1)
    mask = torch.zeros(b, 40, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batch = {"latents": torch.randn(b, 4, 4, 6, generator=g), "text_embeds": torch.randn(b, 40, 32, generator=g),
             "text_mask": mask}
    inputs, targets = zi.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t, text, _ = inputs
    assert torch.allclose(x_t, batch["latents"] + t.view(-1, 1, 1, 1) * targets[0], atol=1e-5)
    out = inputs
    with torch.no_grad():
        for layer in zi.split_into_layers(model, cfg):
            out = layer(out)
        sample = model(list(x_t.unsqueeze(2)), (1000 - t * 1000) / 1000, [text[i, :n] for i, n in enumerate(lengths)])
    expected = -torch.stack(sample.sample).squeeze(2)  # ZImagePipeline: noise_pred = -output
    assert out[0].shape == batch["latents"].shape
    torch.testing.assert_close(out[0], expected, rtol=1e-4, atol=1e-5)


def test_both_layouts_load_the_same_weights_as_diffusers_converts_them(tiny_zimage: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    folder = zi.load_diffusion_model(tiny_config(tiny_zimage), CPU, torch.float32).state_dict()
    single = zi.load_diffusion_model(tiny_config(tiny_zimage, diffusion_model=original_path(tiny_zimage)), CPU,
                                     torch.float32).state_dict()
    assert folder.keys() == single.keys() and len(folder) > 50
    for key in folder:
        assert torch.equal(folder[key], single[key]), key
    original = load_file(str(original_path(tiny_zimage)))
    assert {"layers.1.attention.qkv.weight", "noise_refiner.0.attention.out.weight", "x_embedder.weight",
            "final_layer.adaLN_modulation.1.bias", "context_refiner.1.attention.q_norm.weight"} <= set(original)
    prefixed = {f"model.diffusion_model.{k}": v for k, v in original.items()}
    converted = convert_z_image_transformer_checkpoint_to_diffusers(dict(prefixed))
    assert converted.keys() == folder.keys()
    for key in folder:
        assert torch.equal(converted[key], folder[key]), key
    assert original_to_diffusers(prefixed).keys() == folder.keys()


def test_bad_single_file_names_file_and_key(tiny_zimage: Path, tmp_path: Path) -> None:
    bad = load_file(str(original_path(tiny_zimage)))
    file = tmp_path / "bad.safetensors"
    load = lambda: zi.load_diffusion_model(tiny_config(tiny_zimage, diffusion_model=file), CPU, torch.float32)  # noqa: E731
    save_file({k: v for k, v in bad.items() if k != "layers.0.attention.qkv.weight"}, str(file))
    with pytest.raises(KeyError, match=r"bad\.safetensors.*missing key 'layers\.0\.attention\.qkv\.weight'"):
        load()
    save_file({**bad, "x_embedder.bias": torch.zeros(3)}, str(file))
    with pytest.raises(ValueError, match=r"(?s)bad\.safetensors.*all_x_embedder\.2-1\.bias"):
        load()
    # a file in diffusers' names is read as such (issue 35): it validates and loads the folder's weights
    diffusers_file = tiny_zimage / "transformer" / "diffusion_pytorch_model.safetensors"
    assert zi.validate_model_files(tiny_config(tiny_zimage, diffusion_model=diffusers_file)) == []
    from_file = zi.load_diffusion_model(tiny_config(tiny_zimage, diffusion_model=diffusers_file), CPU, torch.float32)
    from_folder = zi.load_diffusion_model(tiny_config(tiny_zimage), CPU, torch.float32).state_dict()
    assert all(torch.equal(v, from_folder[k]) for k, v in from_file.state_dict().items())


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_zimage: Path, layout: str) -> None:
    single = {"diffusion_model": original_path(tiny_zimage)} if layout == "original" else {}
    registry = Registry()
    assert registry.register_model("z-image", zi).ok
    stages = assert_stages_read_their_own(registry.model("z-image"), tiny_config(tiny_zimage, **single))
    blocks = [{".".join(k.split(".")[:2]) for k in s.reads if k.startswith("layers.")} for s in stages]
    assert "layers.1" in blocks[1] and "layers.1" not in blocks[0]


def lora_model(targets: list[str], rank: int = 4):
    model = tiny_transformer(TinyZImageConfig())
    runs.with_random_lora(model, targets, rank)
    return model


def test_comfyui_lora_applies_to_the_original_weights_like_the_separate_loras(tiny_zimage: Path) -> None:
    targets = zi.lora_targets(tiny_config(tiny_zimage))
    model = lora_model(targets)
    state = lora_state_dict(model)
    adapted = {k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")}
    assert "layers.1.adaLN_modulation.0" in adapted and "context_refiner.0.feed_forward.w2" in adapted
    assert not any(m.startswith("all_final_layer") for m in adapted)
    comfy = zi.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    assert comfy["diffusion_model.layers.0.attention.qkv.lora_A.weight"].shape == (12, 32)
    assert float(comfy["diffusion_model.layers.0.attention.qkv.alpha"]) == 18.0
    assert float(comfy["diffusion_model.context_refiner.1.attention.out.alpha"]) == 6.0
    assert "diffusion_model.noise_refiner.0.adaLN_modulation.0.lora_B.weight" in comfy
    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    got = original_to_diffusers(apply_comfyui_lora(diffusers_to_original(base), comfy))
    runs.assert_state_close(got, runs.merge_peft(base, state, 6.0 / 4))
    # LoKr/LoHa stems: ComfyUI's Z-Image key map takes the diffusers names under the pipeline prefix
    assert zi.adapter_key_names(modules=["layers.0.attention.to_q"], format="comfyui") == {
        "layers.0.attention.to_q": "transformer.layers.0.attention.to_q"
    }


def test_full_model_exports_load_back(tiny_zimage: Path, tmp_path: Path) -> None:
    from diffusers import ZImageTransformer2DModel

    cfg = tiny_config(tiny_zimage)
    model = zi.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        model.layers[1].feed_forward.w1.weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(zi, model, cfg, saved)
    single = saved / "single_file" / "z_image_transformer.safetensors"
    from_single = zi.load_diffusion_model(tiny_config(tiny_zimage, diffusion_model=single), CPU, torch.float32)
    from_folder = ZImageTransformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder[key], value), key
