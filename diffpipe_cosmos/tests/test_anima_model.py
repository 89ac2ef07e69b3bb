"""Anima: the cached text is ``AnimaTextEncoderStep.encode_prompt``'s, the latents the pipeline's; the layers chained
(LLM adapter included) equal the adapter then ``CosmosTransformer3DModel.forward``; the ComfyUI single file and the
folder load the same weights and each stage reads only its own; the default LoRA targets all get gradients (the
adapter's with ``llm_adapter_lr``); ``llm_adapter_lr`` is the ``llm_adapter`` group's rate in ``[optimizer]
group_lr``, 0 freezing it; samples equal ``AnimaModularPipeline``'s for the same seed; the kit passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_core.types import EncodeBatch, SampleRequest
from diffpipe_cosmos.anima import anima as plugin
from diffpipe_cosmos.anima import text_inputs
from diffpipe_cosmos.config import AnimaConfig
from diffpipe_cosmos.testing_anima import comfy_path, load_pipeline

CPU = torch.device("cpu")
CAPTIONS = ["a red cat on the house", "a dog", ""]
LENGTH = 16


def config(path: Path, **extra):
    table = {"type": "anima", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": LENGTH}
    return validate(AnimaConfig, {**table, **extra}, "test")


@pytest.fixture(scope="module")
def pipe(tiny_anima: Path):
    return load_pipeline(tiny_anima)


def test_text_and_latents_are_the_pipelines(tiny_anima: Path, pipe) -> None:
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    enc = plugin.load_encoders(config(tiny_anima), CPU)
    out = plugin.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    assert {k: tuple(v.shape) for k, v in out.items() if k != "qwen_embeds"} == dict.fromkeys(
        ("qwen_mask", "t5_ids", "t5_mask"), (3, LENGTH))
    for row, caption in enumerate(CAPTIONS):  # each caption alone, as the pipeline encodes a prompt
        want = AnimaTextEncoderStep.encode_prompt(pipe, caption, prepare_unconditional_embeds=False,
                                                  max_sequence_length=LENGTH, device=CPU, dtype=torch.float32)
        got = text_inputs({k: v[row : row + 1] for k, v in out.items()})
        q = int(want["qwen_attention_mask"].sum())
        assert got[1].tolist() == want["qwen_attention_mask"].tolist() or q == 0
        torch.testing.assert_close(got[0][:, :q], want["qwen_prompt_embeds"][:, :q], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[2], want["t5_input_ids"]) and torch.equal(got[3], want["t5_attention_mask"])
        assert not out["qwen_embeds"][row, q:].any()  # zero past the caption
    # the adapter's text of the cached rows, batched, is the pipeline's of each prompt alone
    text = pipe.text_conditioner(*(lambda q, qm, i, im: (q, i, im, qm))(*text_inputs(out)))
    for row, caption in enumerate(CAPTIONS):
        want = AnimaTextEncoderStep.encode_prompt(pipe, caption, prepare_unconditional_embeds=False,
                                                  max_sequence_length=LENGTH, device=CPU, dtype=torch.float32)
        alone = pipe.text_conditioner(want["qwen_prompt_embeds"], want["t5_input_ids"], want["t5_attention_mask"],
                                      want["qwen_attention_mask"])
        torch.testing.assert_close(text[row : row + 1], alone, atol=1e-5, rtol=1e-5)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = plugin.encode_batch(enc, EncodeBatch(pixels=pixels))["latents"]
    with torch.no_grad():
        z = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
    # the pipeline's decoder step computes latents / (1 / std) + mean: the cache holds its inverse
    torch.testing.assert_close(plugin.denormalize(latents, pipe.vae), z, atol=1e-5, rtol=1e-5)


def test_layers_chained_equal_the_adapter_and_the_forward(tiny_anima: Path, pipe) -> None:
    from diffpipe_cosmos.resize import install

    install()
    model = plugin.load_diffusion_model(config(tiny_anima), CPU, torch.float32).eval()
    enc = plugin.load_encoders(config(tiny_anima), CPU)
    text = text_inputs(plugin.encode_batch(enc, EncodeBatch(captions=CAPTIONS[:2])))
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 4, 1, 4, 6, generator=g), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        embeds = model.text_conditioner(text[0], text[2], text[3], text[1])
        want = model(hidden_states=x, timestep=t, encoder_hidden_states=embeds,
                     padding_mask=torch.zeros(1, 1, 32, 48), return_dict=False)[0]
        got = (x, t, *text)
        for layer in plugin.split_into_layers(model, None):
            got = layer(got)
    assert got[0].dtype == torch.float32 and got[0].shape == want.shape == (2, 4, 1, 4, 6)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


def test_both_layouts_load_the_same_and_stages_read_their_own(tiny_anima: Path) -> None:
    folder, single = config(tiny_anima), config(tiny_anima, diffusion_model=comfy_path(tiny_anima))
    registry = Registry()
    assert registry.register_model("anima", plugin).ok
    assert plugin.validate_model_files(single) == [] and plugin.validate_model_files(folder) == []
    a = plugin.load_diffusion_model(folder, CPU, torch.float32).state_dict()
    b = plugin.load_diffusion_model(single, CPU, torch.float32).state_dict()
    assert any(k.startswith("text_conditioner.blocks.1.") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for cfg in (folder, single):
        reads = assert_stages_read_their_own(registry.model("anima"), cfg, stages=2)
        # stage 0: the adapter, the embedding and block 0; stage 1: block 1 and the final layer
        assert "text_conditioner.out_proj.weight" in reads[0].tensors
        assert "proj_out.weight" in reads[1].tensors and "text_conditioner.out_proj.weight" not in reads[1].tensors


@pytest.mark.parametrize("adapter_lr", [0.0, 1e-4])
def test_default_lora_targets_all_get_gradients(tiny_anima: Path, adapter_lr: float) -> None:
    import peft

    cfg = config(tiny_anima, llm_adapter_lr=adapter_lr)
    model = plugin.load_diffusion_model(cfg, CPU, torch.float32)
    targets = plugin.lora_targets(cfg)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False))
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
               for n, _ in peft_model.named_modules() if n.endswith(".lora_A.default")}
    blocks = {n for n in adapted if n.startswith("transformer_blocks.")}
    adapter = {n for n in adapted if n.startswith("text_conditioner.blocks.")}
    assert len(blocks) == 2 * 10 and adapted == blocks | adapter
    assert len(adapter) == (2 * 10 if adapter_lr else 0)
    enc = plugin.load_encoders(cfg, CPU)
    out = (torch.randn(1, 4, 1, 4, 4), torch.tensor([0.5]),
           *text_inputs(plugin.encode_batch(enc, EncodeBatch(captions=["a red cat"]))))
    for layer in plugin.split_into_layers(model, None):
        out = layer(out)
    out[0].square().mean().backward()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())


def test_llm_adapter_lr_is_its_group_lr_and_zero_freezes_it(tiny_anima: Path) -> None:
    from diffpipe_core.config import RunConfig, with_model_group_lr
    from diffpipe_core.optim import freeze_zero_lr_groups, parameter_groups

    named = plugin.parameter_groups(config(tiny_anima))
    run = RunConfig(model={"type": "anima"})
    wrapped = registered(plugin, "anima")
    assert plugin.group_lr_defaults(config(tiny_anima)) == {"llm_adapter": 0.0}
    default = with_model_group_lr(run, wrapped, config(tiny_anima))
    assert default.optimizer.group_lr == {"llm_adapter": 0.0}
    trained = with_model_group_lr(run, wrapped, config(tiny_anima, llm_adapter_lr=1e-5))
    assert trained.optimizer.group_lr == {"llm_adapter": 1e-5}
    given = run.model_copy(update={"optimizer": run.optimizer.model_copy(update={"group_lr": {"llm_adapter": 3e-6}})})
    assert with_model_group_lr(given, wrapped, config(tiny_anima)).optimizer.group_lr == {"llm_adapter": 3e-6}
    model = plugin.load_diffusion_model(config(tiny_anima), CPU, torch.float32).requires_grad_(True)
    groups = parameter_groups(trained.optimizer, dict(model.named_parameters()), named)
    lrs = {g["name"]: (g["lr"], len(g["params"])) for g in groups}
    adapter_count = len(list(model.text_conditioner.parameters()))
    assert lrs["llm_adapter"] == (1e-5, adapter_count) and lrs["transformer"][0] == trained.optimizer.lr
    frozen = freeze_zero_lr_groups(model, default.optimizer, named)
    assert len(frozen) == adapter_count and all(n.startswith("text_conditioner.") for n in frozen)
    assert not any(p.requires_grad for p in model.text_conditioner.parameters())
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("text_conditioner."))


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_sample_equals_the_modular_pipeline(tiny_anima: Path, pipe, cfg_scale: float) -> None:
    from diffpipe_core.sampling.loop import noise_generator
    from diffpipe_core.sampling.prompts import encode_prompts

    model, cfg = registered(plugin, "anima"), config(tiny_anima)
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(model, cfg, ["a red cat on a house"], negative, CPU)
    ours = sample_latents(model, cfg, SampleRequest(width=32, height=32, steps=3), texts, 5, cfg_scale)
    noise = torch.randn((1, 4, 4, 4), generator=noise_generator(5, 0))
    pipe.guider.guidance_scale = cfg_scale  # the pipeline's guider: uncond + g * (cond - uncond), as cfg
    with torch.no_grad():
        out = pipe(prompt="a red cat on a house", negative_prompt=negative or "", latents=noise.unsqueeze(2),
                   height=32, width=32, num_inference_steps=3, max_sequence_length=LENGTH, output="latents")
    assert_same_sample(ours, out[:, :, 0], noise)


def test_anima_conforms(tiny_anima: Path) -> None:
    table = {"type": "anima", "path": tiny_anima, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 8}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(plugin, "anima", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
