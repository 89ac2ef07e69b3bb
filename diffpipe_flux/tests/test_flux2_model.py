"""FLUX.2 [dev] and [klein] in-process, against diffusers: the caption tensors equal the pipelines' ``encode_prompt``
(dev: Mistral3 on the system message and the caption, hidden layers 10, 20, 30; Klein: Qwen3 on the chat template,
hidden layers 9, 18, 27; side by side), the latents their ``_encode_vae_image``'s (the mode in 2x2 patches,
batch-norm normalised), the layers chained equal ``Flux2Transformer2DModel.forward`` (with and without guidance),
both on-disk layouts (the diffusers folder and the BFL / ComfyUI single file) load the same weights, which are what
diffusers' own FLUX.2 converter makes of the file, each of 2 stages reads only its own tensors, the conformance kit
passes for both entry points (LoRA gradients on every default target included), and a Klein sample with true CFG,
decoded, is the pipeline's image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.flux2 import flux2, klein
from diffpipe_flux.testing import bfl_path

CAPTIONS = ["a red cat", "a photo of a dog on a tree"]


@dataclass
class Variant:
    name: str
    plugin: Any
    pipeline: str
    fixture: str
    length: int  # text tokens: the system message (dev) or chat template (Klein) and the caption fit
    first_layer: int  # the pipeline's first stacked hidden layer


VARIANTS = {
    "flux2-klein": Variant("flux2-klein", klein, "Flux2KleinPipeline", "tiny_klein", 24, 9),
    "flux2": Variant("flux2", flux2, "Flux2Pipeline", "tiny_flux2", 48, 10),
}


@pytest.fixture(params=list(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[Variant, Path]:
    v = VARIANTS[request.param]
    return v, request.getfixturevalue(v.fixture)


def table(v: Variant, path: Path, **kw) -> dict:
    return {"type": v.name, "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": v.length,
            **kw}  # fmt: skip


def config(v: Variant, path: Path, **kw) -> Any:
    return validate(v.plugin.spec.config_schema, table(v, path, **kw), "test")


def chat(v: Variant, tokenizer: Any, caption: str) -> str:
    """The caption as the pipeline renders it for its text encoder."""
    if v.name == "flux2":
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        return tokenizer.apply_chat_template(format_input([caption]), tokenize=False)[0]
    messages = [{"role": "user", "content": caption}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def test_captions_equal_encode_prompt(variant) -> None:
    import diffusers

    v, folder = variant
    enc = v.plugin.load_encoders(config(v, folder), torch.device("cpu"))
    text = v.plugin.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    pipe = getattr(diffusers, v.pipeline).from_pretrained(
        str(folder), transformer=None, vae=None, local_files_only=True
    )
    embeds, _ = pipe.encode_prompt(list(CAPTIONS), max_sequence_length=v.length)
    assert set(text) == {"text_embeds"} and text["text_embeds"].shape == (2, v.length, 3 * 16)
    torch.testing.assert_close(text["text_embeds"], embeds, rtol=0, atol=1e-6)
    # the first third is the first stacked hidden layer of the encoder on the templated caption
    rendered = chat(v, enc.tokenizer, CAPTIONS[0])
    assert CAPTIONS[0] in rendered and len(rendered) > len(CAPTIONS[0]) + 20
    ids = enc.tokenizer(rendered, padding="max_length", max_length=v.length, truncation=True, return_tensors="pt",
                        add_special_tokens=False)  # fmt: skip
    assert ids.attention_mask.sum() < v.length  # nothing of the caption is cut off
    with torch.no_grad():
        hidden = enc.text_encoder(**ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(text["text_embeds"][:1, :, :16], hidden[v.first_layer], rtol=0, atol=1e-6)
    assert not torch.allclose(hidden[v.first_layer], hidden[3 * v.first_layer], atol=1e-3)


def test_latents_equal_the_pipelines(tiny_klein: Path) -> None:
    """The same VAE and code path for both (Flux2Pipeline._encode_vae_image is Klein's)."""
    from diffusers import AutoencoderKLFlux2

    from diffpipe_core.parts.text import text_pipeline
    from diffpipe_flux.flux2_latents import patchify

    v = VARIANTS["flux2-klein"]
    enc = klein.load_encoders(config(v, tiny_klein), torch.device("cpu"))
    pixels = torch.rand(2, 3, 32, 48) * 2 - 1
    ours = klein.encode_batch(enc, EncodeBatch(pixels=pixels))["latents"]
    vae = AutoencoderKLFlux2.from_pretrained(str(tiny_klein / "vae"), local_files_only=True)
    with torch.no_grad():
        expected = text_pipeline("Flux2KleinPipeline", vae=vae)._encode_vae_image(pixels, None)
        assert torch.equal(expected, text_pipeline("Flux2Pipeline", vae=vae)._encode_vae_image(pixels, None))
        plain = patchify(vae.encode(pixels).latent_dist.mode())
    assert ours.shape == (2, 16, 2, 3)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert (ours - plain).abs().max() > 0.1  # the batch-norm statistics are applied
    # and undone before decoding: the VAE gets back its own latents
    torch.testing.assert_close(klein.denormalize(ours, vae), vae.encode(pixels).latent_dist.mode(), rtol=0, atol=1e-5)


def test_layers_compute_the_flux2_forward(variant) -> None:
    v, folder = variant
    cfg = config(v, folder, guidance=3.0) if v.name == "flux2" else config(v, folder)
    model = v.plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32).eval()
    batch = {"latents": torch.randn(2, 16, 2, 3), "text_embeds": torch.randn(2, 16, 48)}
    inputs, targets = v.plugin.prepare_inputs(batch, TrainingContext(cfg), torch.Generator().manual_seed(0))
    guidance = inputs[3] if model.config.guidance_embeds else None
    x = inputs
    with torch.no_grad():
        for layer in v.plugin.split_into_layers(model, cfg):
            x = layer(x)
        expected = model(
            hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2], guidance=guidance,
            img_ids=inputs[4][None], txt_ids=inputs[5][None],
        ).sample  # fmt: skip
    assert len(x) == 1 and x[0].shape == targets[0].shape == (2, 6, 16)
    torch.testing.assert_close(x[0], expected, rtol=0, atol=1e-5)
    assert inputs[5][:, 3].tolist() == list(range(16)) and inputs[4][4].tolist() == [0, 1, 1, 0]
    assert model.config.guidance_embeds == (v.name == "flux2") and inputs[3].tolist() == [cfg_guidance(cfg)] * 2
    if guidance is not None:  # the guidance input matters
        with torch.no_grad():
            other = model(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                          guidance=guidance + 1, img_ids=inputs[4][None], txt_ids=inputs[5][None]).sample  # fmt: skip
        assert (other - expected).abs().max() > 1e-4


def cfg_guidance(cfg: Any) -> float:
    return float(getattr(cfg, "guidance", 1.0))


def test_both_layouts_load_the_same_weights_as_diffusers_converts_them(variant) -> None:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    v, path = variant
    folder = v.plugin.load_diffusion_model(config(v, path), torch.device("cpu"), torch.float32).state_dict()
    single_cfg = config(v, path, diffusion_model=bfl_path(path))
    single = v.plugin.load_diffusion_model(single_cfg, torch.device("cpu"), torch.float32).state_dict()
    original = load_file(str(bfl_path(path)))
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(dict(original))
    assert folder.keys() == single.keys() == theirs.keys() and len(folder) > 40
    for key in folder:
        assert torch.equal(folder[key], single[key]) and torch.equal(folder[key], theirs[key]), key
    assert {"double_stream_modulation_img.lin.weight", "double_blocks.0.img_attn.qkv.weight",
            "single_blocks.1.linear1.weight", "final_layer.adaLN_modulation.1.weight"} <= set(original)  # fmt: skip
    assert not any("transformer_blocks" in k for k in original)
    assert any(k.startswith("guidance_in.") for k in original) == (v.name == "flux2")


def test_single_file_is_read_per_stage(tiny_klein: Path) -> None:
    cfg = config(VARIANTS["flux2-klein"], tiny_klein, diffusion_model=bfl_path(tiny_klein))
    first, second = assert_stages_read_their_own(get_registry().model("flux2-klein"), cfg)
    assert set(first.reads) | set(second.reads) == set(load_file(str(bfl_path(tiny_klein))))
    assert "double_stream_modulation_img.lin.weight" in first.reads and "final_layer.linear.weight" in second.reads


def test_the_other_variants_folder_is_refused(tiny_klein: Path, tiny_flux2: Path) -> None:
    dev_problems = (
        get_registry().model("flux2").call("validate_model_files", model_config=config(VARIANTS["flux2"], tiny_klein))
    )
    assert any("'Flux2KleinPipeline'" in p and "expects 'Flux2Pipeline'" in p for p in dev_problems), dev_problems
    klein_problems = (
        get_registry()
        .model("flux2-klein")
        .call("validate_model_files", model_config=config(VARIANTS["flux2-klein"], tiny_flux2))
    )
    assert any("'Flux2Pipeline'" in p and "expects 'Flux2KleinPipeline'" in p for p in klein_problems), klein_problems


def test_plugin_conforms(variant) -> None:
    """From the BFL / ComfyUI single file (the folder layout's loading: the tests above)."""
    v, folder = variant
    model = table(v, folder, diffusion_model=bfl_path(folder))
    check_model_plugin(v.plugin, v.name, model, torch.rand(2, 3, 32, 48) * 2 - 1, CAPTIONS)


def test_klein_sample_with_cfg_equals_the_pipelines_image(tiny_klein: Path) -> None:
    """The denoising hooks under the core's loop with true CFG (negative prompt "", the pipeline's), decoded, equal
    ``Flux2KleinPipeline``'s image for the same noise and embeddings (the run's first sample checks CFG 1 and dev)."""
    from diffusers import Flux2KleinPipeline

    from diffpipe_core.sampling.loop import generate, noise_generator
    from diffpipe_core.sampling.pipeline import LayerChainForward
    from diffpipe_core.sampling.prompts import encode_prompts
    from diffpipe_core.sampling.runner import decode
    from diffpipe_core.types import SampleRequest

    plugin, cfg = get_registry().model("flux2-klein"), config(VARIANTS["flux2-klein"], tiny_klein)
    (texts,) = encode_prompts(plugin, cfg, ["a red cat"], "", torch.device("cpu"))
    model = plugin.require("load_diffusion_model", model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)
    forward = LayerChainForward(plugin.require("split_into_layers", model=model, model_config=cfg))
    request = SampleRequest(width=32, height=32, steps=3)
    (ours,) = generate(plugin, cfg, request, [texts], [noise_generator(5, 0)], forward, cfg=4.0)
    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))

    pipe = Flux2KleinPipeline.from_pretrained(str(tiny_klein), dtype=torch.float32, local_files_only=True)
    noise = torch.randn((1, 16, 2, 2), generator=noise_generator(5, 0))
    image = pipe(
        prompt_embeds=texts.cond["text_embeds"], negative_prompt_embeds=texts.uncond["text_embeds"], latents=noise,
        num_inference_steps=3, guidance_scale=4.0, height=32, width=32, output_type="pt",
    ).images[0]  # fmt: skip
    torch.testing.assert_close((pixels + 1) / 2, image, rtol=1e-4, atol=1e-4)
    assert (ours - noise).abs().max() > 0.1  # it denoised
