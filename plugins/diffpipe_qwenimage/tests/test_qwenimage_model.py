"""Issue 23, test 2 and the model's inputs: the layers chained equal ``QwenImageTransformer2DModel.forward`` (with
padded text, reference images and ``zero_cond_t``); the ComfyUI single file and the diffusers folder load to the same
weights, and per-stage loading reads only the stage's tensors from either; the training inputs pack the target and the
reference images as the edit pipelines do, at the pipelines' dynamic shift; the default LoRA targets leave out the
last block's text side."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from diffpipe_core import TrainingContext
from diffpipe_core.parts.latents import pack_2x2
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_core.types import control_key
from diffpipe_qwenimage.config import QwenImageConfig, QwenImageEditConfig
from diffpipe_qwenimage.edit import plugin as edit
from diffpipe_qwenimage.plugin import plugin as qwen
from diffpipe_qwenimage.plugin import training_shift
from diffpipe_qwenimage.testing import TinyQwenConfig, comfy_path, load_pipeline, tiny_transformer


def config(path: Path, schema=QwenImageConfig, **extra):
    return validate(schema, {"type": "qwen-image", "path": path, "dtype": "float32", **extra}, "test")


def chain(layers, inputs):
    x = inputs
    for layer in layers:
        x = layer(x)
    return x[0]


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_layers_chained_equal_the_forward(zero_cond_t: bool) -> None:
    # zero_cond_t: Qwen-Image-Edit-2511, reference tokens modulated at t = 0
    model = tiny_transformer(TinyQwenConfig(), zero_cond_t=zero_cond_t).eval()
    assert model.config.zero_cond_t == zero_cond_t
    g = torch.Generator().manual_seed(0)
    sizes = [(1, 4, 3), (1, 2, 5)]  # the target's and a reference image's (frames, h/2, w/2)
    n = sum(math.prod(s) for s in sizes)
    x, text = torch.randn(2, n, 16, generator=g), torch.randn(2, 7, 32, generator=g)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        want = model(hidden_states=x, encoder_hidden_states=text, encoder_hidden_states_mask=mask, timestep=t,
                     img_shapes=[sizes] * 2).sample[:, : math.prod(sizes[0])]
        got = chain(qwen.split_into_layers(model, None), (x, t, text, mask, torch.tensor(sizes)))
    assert got.dtype == torch.float32 and got.shape == want.shape == (2, 12, 16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_unsupported_transformers_are_named() -> None:
    model = tiny_transformer(TinyQwenConfig(), use_layer3d_rope=True)
    with pytest.raises(ValueError, match="use_layer3d_rope=True"):
        qwen.split_into_layers(model, None)


def test_both_layouts_load_the_same_and_stages_read_their_own(tiny_qwen: Path) -> None:
    folder, single = config(tiny_qwen), config(tiny_qwen, diffusion_model=comfy_path(tiny_qwen))
    registry = Registry()
    assert registry.register_model("qwen-image", qwen).ok
    plugin = registry.model("qwen-image")
    assert qwen.validate_model_files(single) == [] and qwen.validate_model_files(folder) == []
    a = qwen.load_diffusion_model(folder, torch.device("cpu"), torch.float32).state_dict()
    b = qwen.load_diffusion_model(single, torch.device("cpu"), torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for cfg in (folder, single):
        reads = assert_stages_read_their_own(plugin, cfg, stages=2)
        assert all(not r.startswith("model.diffusion_model.") or cfg is single for s in reads for r in s.reads)
        # stage 0 holds the embedders and block 0, stage 1 block 1 and the final layer
        assert any(k.startswith("img_in.") for k in reads[0].tensors) and "proj_out.weight" in reads[1].tensors
    # the skeleton's RoPE tables (no file holds them) are real tensors, so a meta-built model computes
    meta = qwen.load_diffusion_model(folder, torch.device("meta"), torch.float32)
    assert meta.pos_embed.pos_freqs.device.type == "cpu"


def test_the_comfyui_file_is_refused_when_it_does_not_fit(tiny_qwen: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(comfy_path(tiny_qwen)))
    del state["model.diffusion_model.transformer_blocks.1.attn.to_q.weight"]
    save_file(state, str(tmp_path / "cut.safetensors"))
    cfg = config(tiny_qwen, diffusion_model=tmp_path / "cut.safetensors")
    [problem] = qwen.validate_model_files(cfg)
    assert "cut.safetensors: fills" in problem and "another size or variant" in problem
    with pytest.raises(ValueError, match=r"cut\.safetensors: 1 of the model's tensors .*'transformer_blocks\.1\.attn"):
        qwen.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    problems = edit.validate_model_files(config(tiny_qwen, QwenImageEditConfig))
    assert problems and "model 'qwen-image-edit' expects 'QwenImageEditPlusPipeline'" in problems[0]


def test_edit_inputs_pack_the_references_as_the_pipeline(tiny_edit_plus: Path) -> None:
    cfg = config(tiny_edit_plus, QwenImageEditConfig)
    g = torch.Generator().manual_seed(0)
    target, ref0, ref1 = torch.randn(2, 4, 8, 6, generator=g), torch.randn(2, 4, 4, 6, generator=g), torch.randn(
        2, 4, 6, 4, generator=g)
    text = torch.randn(2, 64, 32, generator=g)
    mask = torch.zeros(2, 64, dtype=torch.long)
    mask[0, :9], mask[1, :5] = 1, 1
    batch = {"latents": target, control_key(0, "latents"): ref0, control_key(1, "latents"): ref1,
             "text_embeds": text, "text_mask": mask}
    (x, t, embeds, text_mask, shapes), (velocity,) = edit.prepare_inputs(
        batch, TrainingContext(cfg), torch.Generator().manual_seed(1))
    pipe = load_pipeline(tiny_edit_plus)
    refs = [r.unsqueeze(2) for r in (ref0, ref1)]  # the pipeline takes normalised image latents (B, C, 1, h, w)
    noisy, image_latents = pipe.prepare_latents(refs, 2, 4, 64, 48, torch.float32, torch.device("cpu"),
                                                None, latents=pack_2x2(target))
    assert torch.equal(x[:, 12:], image_latents) and x.shape == (2, 12 + 6 + 6, 16)
    assert shapes.tolist() == [[1, 4, 3], [1, 2, 3], [1, 3, 2]]  # the pipeline's img_shapes
    assert embeds.shape == (2, 9, 32) and torch.equal(embeds, text[:, :9]) and text_mask.dtype == torch.bool
    assert velocity.shape == (2, 12, 16)
    # without references (the conformance kit's batches) the target alone
    plain = {k: v for k, v in batch.items() if not k.startswith("control_")}
    assert edit.prepare_inputs(plain, TrainingContext(cfg), torch.Generator().manual_seed(1))[0][0].shape[1] == 12


def test_training_shift_is_the_pipelines_dynamic_shift(tiny_qwen: Path) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    pipe = load_pipeline(tiny_qwen)
    c = pipe.scheduler.config
    for tokens in (12, 256, 4096):
        mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        assert training_shift(config(tiny_qwen), tokens) == pytest.approx(math.exp(mu))
        # the scheduler's exponential time shift of a sigma is the shift e^mu of it
        sigma = 0.3
        shifted = math.exp(mu) * sigma / (1 + (math.exp(mu) - 1) * sigma)
        assert pipe.scheduler.time_shift(mu, 1.0, sigma) == pytest.approx(shifted)
    assert training_shift(config(tiny_qwen, dynamic_shift=False, shift=3.0), 4096) == 3.0


def test_default_lora_targets_leave_out_the_last_blocks_text_side(tiny_qwen: Path) -> None:
    targets = qwen.lora_targets(config(tiny_qwen))
    text_side = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    for name in text_side:  # block 0 of 2 by full name, block 1 (the last) not at all
        assert f"transformer_blocks.0.{name}" in targets and name not in targets
        assert not [t for t in targets if t.startswith("transformer_blocks.1.")]
    assert {"attn.to_q", "attn.add_k_proj", "attn.add_v_proj", "img_mlp.net.2"} <= set(targets)
