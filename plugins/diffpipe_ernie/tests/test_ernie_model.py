"""ERNIE-Image against diffusers, in-process: the text tensors against ErnieImagePipeline.encode_prompt (every token,
the penultimate hidden layer); the latents as the pipeline un-normalises them (its batch-norm epsilon); the pipeline
layers against ErnieImageTransformer2DModel.forward (captions of different lengths); ComfyUI's single file loads the
folder's weights; per-stage loading reads only each stage's tensors; a bad file is named; full fine-tune exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.registry import Registry
from diffpipe_core.testing import runs
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_ernie.plugin import plugin as ernie
from diffpipe_ernie.testing import COMFY_PREFIX, comfy_path, tiny_config

CPU = torch.device("cpu")
CAPTIONS = ["a red cat", "a photo of a large dark mountain with a river in the city on a bright sky"]


def test_text_tensors_equal_the_pipeline_encode_prompt(tiny_ernie: Path) -> None:
    from diffusers import ErnieImagePipeline

    enc = ernie.load_encoders(tiny_config(tiny_ernie), CPU)
    out = ernie.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))
    pipe = ErnieImagePipeline.from_pretrained(str(tiny_ernie), local_files_only=True)
    expected = pipe.encode_prompt(list(CAPTIONS), device=CPU)
    assert out["text_embeds"].shape == (2, 24, 24) and out["text_mask"].shape == (2, 24)
    for i, want in enumerate(expected):
        n = want.shape[0]
        assert int(out["text_mask"][i].sum()) == n and bool(out["text_mask"][i, :n].all())
        torch.testing.assert_close(out["text_embeds"][i, :n], want.float(), rtol=0, atol=0)
        assert not out["text_embeds"][i, n:].any()
    assert expected[1].shape[0] > expected[0].shape[0]
    ids = pipe.tokenizer(CAPTIONS[0], return_tensors="pt").input_ids
    assert int(ids[0, 0]) == pipe.tokenizer.bos_token_id  # <s> first, as Ministral's tokenizer adds it
    with torch.no_grad():  # the penultimate hidden state, not the last
        last = pipe.text_encoder(input_ids=ids).last_hidden_state[0]
    assert not torch.allclose(last, expected[0], atol=1e-3)


def test_a_caption_over_text_max_length_is_refused_by_name(tiny_ernie: Path) -> None:
    enc = ernie.load_encoders(tiny_config(tiny_ernie, text_max_length=6), CPU)
    with pytest.raises(ValueError, match=r"caption 'a photo of a large.*tokens, over \[model\] text_max_length = 6"):
        ernie.encode_batch(enc, EncodeBatch(captions=list(CAPTIONS)))


def test_latents_as_the_pipeline_unnormalises_them(tiny_ernie: Path) -> None:
    from diffusers import ErnieImagePipeline

    enc = ernie.load_encoders(tiny_config(tiny_ernie), CPU)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = ernie.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    vae = enc.vae
    assert vae.config.batch_norm_eps != 1e-5  # the pipeline's own epsilon differs from the config's: it must be used
    with torch.no_grad():
        mode = vae.encode(pixels).latent_dist.mode()
    patched = ErnieImagePipeline._patchify_latents(mode)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)
    expected = (patched - vae.bn.running_mean.view(1, -1, 1, 1)) / std
    assert media["latents"].shape == (2, 16, 8, 12)  # the tiny VAE halves, the patches halve again
    torch.testing.assert_close(media["latents"], expected, rtol=0, atol=1e-5)
    # decoding undoes it exactly as the pipeline does before vae.decode
    undone = ernie.denormalize(media["latents"], vae)
    torch.testing.assert_close(undone, ErnieImagePipeline._unpatchify_latents(expected * std + vae.bn.running_mean
                                                                               .view(1, -1, 1, 1)), rtol=0, atol=1e-5)
    torch.testing.assert_close(undone, mode, rtol=0, atol=1e-5)
    assert media["mask"].shape == (2, 1, 8, 12) and media["mask"][..., :4, :].min() == 1


@pytest.mark.parametrize("lengths", [(5, 17), (9,)])
def test_layers_compute_the_diffusers_forward(tiny_ernie: Path, lengths: tuple[int, ...]) -> None:
    cfg = tiny_config(tiny_ernie)
    model = ernie.load_diffusion_model(cfg, CPU, torch.float32).eval()
    b, g = len(lengths), torch.Generator().manual_seed(1)
    mask = torch.zeros(b, 24, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batch = {"latents": torch.randn(b, 16, 4, 6, generator=g), "text_embeds": torch.randn(b, 24, 24, generator=g)
             * mask[..., None], "text_mask": mask}
    inputs, targets = ernie.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t, text, _ = inputs
    assert torch.allclose(x_t, batch["latents"] + t.view(-1, 1, 1, 1) * targets[0], atol=1e-5)
    assert text.shape[1] == max(lengths)
    out = inputs
    with torch.no_grad():
        for layer in ernie.split_into_layers(model, cfg):
            out = layer(out)
        expected = model(x_t, t * 1000, text, torch.tensor(lengths), return_dict=False)[0]
    assert out[0].shape == batch["latents"].shape
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-6)


def test_comfyui_single_file_loads_the_folder_weights(tiny_ernie: Path) -> None:
    folder = ernie.load_diffusion_model(tiny_config(tiny_ernie), CPU, torch.float32).state_dict()
    cfg = tiny_config(tiny_ernie, diffusion_model=comfy_path(tiny_ernie))
    assert ernie.validate_model_files(cfg) == []
    single = ernie.load_diffusion_model(cfg, CPU, torch.float32).state_dict()
    assert folder.keys() == single.keys() and len(folder) > 30
    assert all(torch.equal(folder[k], single[k]) for k in folder)


def test_bad_single_file_names_file_and_key(tiny_ernie: Path, tmp_path: Path) -> None:
    good = load_file(str(comfy_path(tiny_ernie)))
    file = tmp_path / "bad.safetensors"
    save_file({k: v for k, v in good.items() if not k.endswith("layers.1.mlp.up_proj.weight")}, str(file))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*not in the file.*layers\.1\.mlp\.up_proj\.weight"):
        ernie.load_diffusion_model(tiny_config(tiny_ernie, diffusion_model=file), CPU, torch.float32)


@pytest.mark.parametrize("layout", ["diffusers", "comfyui"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_ernie: Path, layout: str) -> None:
    single = {"diffusion_model": comfy_path(tiny_ernie)} if layout == "comfyui" else {}
    registry = Registry()
    assert registry.register_model("ernie-image", ernie).ok
    stages = assert_stages_read_their_own(registry.model("ernie-image"), tiny_config(tiny_ernie, **single))
    reads = [[k.removeprefix(COMFY_PREFIX) for k in s.reads] for s in stages]
    blocks = [{".".join(k.split(".")[:2]) for k in keys if k.startswith("layers.")} for keys in reads]
    assert "layers.1" in blocks[1] and "layers.1" not in blocks[0]


def test_full_model_exports_load_back(tiny_ernie: Path, tmp_path: Path) -> None:
    from diffusers import ErnieImageTransformer2DModel

    cfg = tiny_config(tiny_ernie)
    model = ernie.load_diffusion_model(cfg, CPU, torch.float32)
    with torch.no_grad():
        model.layers[1].mlp.gate_proj.weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(ernie, model, cfg, saved)
    single = saved / "single_file" / "ernie_image_transformer.safetensors"
    from_single = ernie.load_diffusion_model(tiny_config(tiny_ernie, diffusion_model=single), CPU, torch.float32)
    from_folder = ErnieImageTransformer2DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder[key], value), key
