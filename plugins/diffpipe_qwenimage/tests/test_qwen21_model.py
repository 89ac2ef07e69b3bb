"""Qwen-Image 2.1's layers chained equal ``QwenImage21Transformer2DModel.forward`` (padded text, with and without
``causal_condition``); the ComfyUI single file and the diffusers folder load to the same weights and each stage reads
only its own tensors; the training inputs are packed as the pipeline packs latents, at its dynamic shift."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from diffpipe_core import TrainingContext
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_qwenimage.config import QwenImage21Config
from diffpipe_qwenimage.plugin import training_shift
from diffpipe_qwenimage.qwen21 import SCHEDULER, plugin
from diffpipe_qwenimage.testing21 import TinyQwen21Config, comfy_path, load_pipeline, tiny_transformer

CPU = torch.device("cpu")


def config(path: Path, **extra):
    return validate(QwenImage21Config, {"type": "qwen-image-2.1", "path": path, "dtype": "float32", **extra}, "test")


@pytest.mark.parametrize("causal_condition", [True, False])
def test_layers_chained_equal_the_forward(causal_condition: bool) -> None:
    model = tiny_transformer(TinyQwen21Config(), causal_condition=causal_condition).eval()
    g = torch.Generator().manual_seed(0)
    h, w = 4, 6
    x, text = torch.randn(2, h * w, 4, generator=g), torch.randn(2, 7, 32, generator=g)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)  # the second caption padded
    t = torch.tensor([0.3, 0.8])
    slots = torch.cat([torch.zeros(2, 7, dtype=torch.bool), torch.ones(2, h * w // 4, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        want = model(hidden_states=x, encoder_hidden_states=text, encoder_hidden_states_mask=mask, timestep=t,
                     img_shapes=[[(1, h, w)]] * 2, img_mask=slots).sample[:, -h * w :]
        got = x, t, text, mask, torch.tensor([[1, h, w]])
        for layer in plugin.split_into_layers(model, None):
            got = layer(got)
    assert got[0].dtype == torch.float32 and got[0].shape == want.shape == (2, 24, 4)
    torch.testing.assert_close(got[0], want, atol=1e-6, rtol=1e-5)


def test_a_patched_transformer_is_named() -> None:
    with pytest.raises(ValueError, match="patch_size=2"):
        plugin.split_into_layers(tiny_transformer(TinyQwen21Config(), patch_size=2), None)


def test_both_layouts_load_the_same_and_stages_read_their_own(tiny_qwen21: Path) -> None:
    folder, single = config(tiny_qwen21), config(tiny_qwen21, diffusion_model=comfy_path(tiny_qwen21))
    registry = Registry()
    assert registry.register_model("qwen-image-2.1", plugin).ok
    assert plugin.validate_model_files(single) == [] and plugin.validate_model_files(folder) == []
    a = plugin.load_diffusion_model(folder, CPU, torch.float32).state_dict()
    b = plugin.load_diffusion_model(single, CPU, torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for cfg in (folder, single):
        reads = assert_stages_read_their_own(registry.model("qwen-image-2.1"), cfg, stages=2)
        # stage 0 holds the embedders (and the shared modulation) and block 0, stage 1 block 1 and the final layer
        assert "modulation.1.weight" in reads[0].tensors and "proj_out.weight" in reads[1].tensors


def test_a_folder_of_another_model_is_named(tiny_qwen21: Path, tmp_path: Path) -> None:
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_qwen21, other)
    te = json.loads((other / "text_encoder" / "config.json").read_text())
    te["text_config"]["hidden_size"] = 64
    (other / "text_encoder" / "config.json").write_text(json.dumps(te))
    [problem] = plugin.validate_model_files(config(other))
    assert "text_config.hidden_size is 64" in problem and "context_in_dim 32" in problem


def test_inputs_are_packed_as_the_pipeline_at_its_shift(tiny_qwen21: Path, caplog: pytest.LogCaptureFixture) -> None:
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    plugin.__dict__.pop("_padding_noted", None)
    cfg = config(tiny_qwen21)
    g = torch.Generator().manual_seed(0)
    latents, text = torch.randn(2, 4, 4, 6, generator=g), torch.randn(2, 32, 32, generator=g)
    mask = torch.zeros(2, 32, dtype=torch.long)
    mask[0, :9], mask[1, :5] = 1, 1
    batch = {"latents": latents, "text_embeds": text, "text_mask": mask}
    (x, t, embeds, text_mask, shapes), (velocity,) = plugin.prepare_inputs(
        batch, TrainingContext(cfg), torch.Generator().manual_seed(1))
    pipe = load_pipeline(tiny_qwen21)
    noise = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(1))  # not the drawn noise: the layout
    assert torch.equal(pipe._pack_latents(noise.unsqueeze(1), 2, 4, 4, 6), noise.flatten(2).transpose(1, 2))
    assert x.shape == velocity.shape == (2, 24, 4) and shapes.tolist() == [[1, 4, 6]]
    assert embeds.shape == (2, 9, 32) and torch.equal(embeds, text[:, :9]) and text_mask.dtype == torch.bool
    # captions of 9 and 5 tokens padded together: said once, with what trains exactly
    assert [r.message for r in caplog.records if "micro_batch_size_per_gpu = 1" in r.message]
    # the shift is the pipeline's for 24 tokens: the tiny scheduler shifts dynamically, exponentially
    c = pipe.scheduler.config
    mu = calculate_shift(24, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    assert training_shift(cfg, 24, SCHEDULER) == pytest.approx(math.exp(mu))
    assert training_shift(config(tiny_qwen21, dynamic_shift=False, shift=3.0), 24, SCHEDULER) == 3.0


def test_default_lora_targets_are_every_block_linear(tiny_qwen21: Path) -> None:
    model = tiny_transformer(TinyQwen21Config())
    targets = plugin.lora_targets(config(tiny_qwen21))
    linears = {n.split("transformer_blocks.0.", 1)[1] for n, m in model.named_modules()
               if n.startswith("transformer_blocks.0.") and isinstance(m, torch.nn.Linear)}
    assert set(targets) == linears
