"""Krea 2's layers chained equal ``Krea2Transformer2DModel.forward`` on the pipeline's middle-padded text, with the
cache's compacted text too; the original layout is diffusers' own conversion, the single file and the folder load to
the same weights and each stage reads only its own tensors; the default LoRA targets (text layers optional) all get
gradients; the training shift is the pipeline's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from diffpipe_core.parts.text import compacted
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_krea.config import Krea2Config, Krea2TurboConfig
from diffpipe_krea.plugin import plugin, turbo
from diffpipe_krea.testing import TinyKrea2Config, comfy_path, load_pipeline, tiny_transformer

CPU = torch.device("cpu")


def config(path: Path, schema=Krea2Config, **extra):
    return validate(schema, {"type": "krea2", "path": path, "dtype": "float32", **extra}, "test")


def test_layers_chained_equal_the_forward() -> None:
    from diffusers import Krea2Pipeline

    model = tiny_transformer(TinyKrea2Config()).eval()
    g = torch.Generator().manual_seed(0)
    h, w = 4, 6
    x, text = torch.randn(2, h * w, 16, generator=g), torch.randn(2, 9, 12, 32, generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 4:7] = False  # the pipeline pads in the middle: caption, padding, the template's closing turn
    t = torch.tensor([0.3, 0.8])
    ids = Krea2Pipeline.prepare_position_ids(9, h, w, CPU)
    with torch.no_grad():
        want = model(hidden_states=x, encoder_hidden_states=text, timestep=t, position_ids=ids,
                     encoder_attention_mask=mask).sample
        for embeds, text_mask in ((text, mask), compacted(text, mask)):
            got = x, t, embeds, text_mask, torch.tensor([h, w])
            for layer in plugin.split_into_layers(model, None):
                got = layer(got)
            assert got[0].dtype == torch.float32 and got[0].shape == want.shape == (2, 24, 16)
            torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


def test_the_original_layout_is_diffusers_conversion(tiny_krea2: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    original = load_file(str(comfy_path(tiny_krea2)))
    assert "model.diffusion_model.blocks.1.mod.lin" in original and original[
        "model.diffusion_model.blocks.1.mod.lin"].dim() == 1  # six vectors in one, as Krea stores them
    converted = convert_krea2_transformer_checkpoint_to_diffusers(dict(original))
    model = plugin.load_diffusion_model(config(tiny_krea2), CPU, torch.float32).state_dict()
    assert converted.keys() == model.keys() and all(torch.equal(converted[k], model[k]) for k in model)


def test_both_layouts_load_the_same_and_stages_read_their_own(tiny_krea2: Path) -> None:
    folder, single = config(tiny_krea2), config(tiny_krea2, diffusion_model=comfy_path(tiny_krea2))
    registry = Registry()
    assert registry.register_model("krea2", plugin).ok
    assert plugin.validate_model_files(single) == [] and plugin.validate_model_files(folder) == []
    a = plugin.load_diffusion_model(folder, CPU, torch.float32).state_dict()
    b = plugin.load_diffusion_model(single, CPU, torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for cfg in (folder, single):
        reads = assert_stages_read_their_own(registry.model("krea2"), cfg, stages=2)
        # stage 0 holds the embedders (the text fusion) and block 0, stage 1 block 1 and the final layer
        assert "text_fusion.projector.weight" in reads[0].tensors and "final_layer.linear.weight" in reads[1].tensors


def test_a_folder_of_another_size_is_named(tiny_krea2: Path, tmp_path: Path) -> None:
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_krea2, other)
    te = json.loads((other / "text_encoder" / "config.json").read_text())
    te["text_config"]["hidden_size"] = 64
    (other / "text_encoder" / "config.json").write_text(json.dumps(te))
    [problem] = plugin.validate_model_files(config(other))
    assert "text_config.hidden_size is 64" in problem and "text_hidden_dim 32" in problem


@pytest.mark.parametrize("text_layers", [True, False])
def test_default_lora_targets_all_get_gradients(tiny_krea2: Path, text_layers: bool) -> None:
    import peft

    model = tiny_transformer(TinyKrea2Config())
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = plugin.lora_targets(config(tiny_krea2, lora_text_layers=text_layers))
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False))
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
               for n, _ in peft_model.named_modules() if n.endswith(".lora_A.default")}
    text = {n for n in linears if n.startswith(("text_fusion.", "txt_in."))}
    blocks = {n for n in linears if n.startswith("transformer_blocks.")}
    assert adapted == (blocks | text if text_layers else blocks)
    g = torch.Generator().manual_seed(0)
    x, embeds = torch.randn(1, 4, 16, generator=g), torch.randn(1, 3, 12, 32, generator=g)
    out = x, torch.tensor([0.5]), embeds, torch.ones(1, 3, dtype=torch.bool), torch.tensor([2, 2])
    for layer in plugin.split_into_layers(model, None):
        out = layer(out)
    out[0].square().mean().backward()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())


def test_the_training_shift_is_the_pipelines(tiny_krea2: Path, tiny_krea2_turbo: Path) -> None:
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    c = load_pipeline(tiny_krea2).scheduler.config
    mu = calculate_shift(1024, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    assert plugin.training_shift(config(tiny_krea2), 1024) == pytest.approx(math.exp(mu))
    assert plugin.training_shift(config(tiny_krea2, dynamic_shift=False, shift=3.0), 1024) == 3.0
    # the distilled checkpoint's fixed mu, from its folder's is_distilled or from the Turbo entry point
    assert plugin.training_shift(config(tiny_krea2_turbo), 1024) == pytest.approx(math.exp(1.15))
    assert turbo.training_shift(config(tiny_krea2, Krea2TurboConfig), 64) == pytest.approx(math.exp(1.15))
