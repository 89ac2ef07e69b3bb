"""Ideogram 4's layers chained equal ``Ideogram4Transformer2DModel.forward`` on the pipeline's left-padded packed
sequence (negated: the velocity ``noise - x0``), from the cache's front-compacted text; the single file (Ideogram's
fused ``attention.qkv``) and the folder load to the same weights and each stage reads only its own tensors; the
default LoRA targets all get gradients."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.parts.text import compacted
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_ideogram.config import Ideogram4Config
from diffpipe_ideogram.plugin import plugin
from diffpipe_ideogram.testing import TinyIdeogram4Config, comfy_path, tiny_transformer

CPU = torch.device("cpu")
FEATURES = 13 * 32


def config(path: Path, **extra):
    return validate(Ideogram4Config, {"type": "ideogram4", "path": path, "dtype": "float32", **extra}, "test")


def pipeline_inputs(x: torch.Tensor, text: torch.Tensor, lengths: list[int], h: int, w: int, t: torch.Tensor):
    """The conditional transformer's inputs as ``Ideogram4Pipeline.__call__`` builds them: ``[left padding, text,
    image]`` (text at the end of its region), ids from ``_prepare_ids``."""
    from diffusers import Ideogram4Pipeline

    b, length = text.shape[:2]
    pos, seg, ind = Ideogram4Pipeline._prepare_ids(lengths, h, w, length, CPU)
    features = torch.zeros(b, length + h * w, text.shape[-1])
    for row, n in enumerate(lengths):
        features[row, length - n : length] = text[row, :n]
    z = torch.cat([torch.zeros(b, length, x.shape[-1]), x], dim=1)
    return {"hidden_states": z, "timestep": 1 - t, "encoder_hidden_states": features, "position_ids": pos,
            "segment_ids": seg, "indicator": ind}


def test_layers_chained_equal_the_forward() -> None:
    model = tiny_transformer(TinyIdeogram4Config()).eval()
    g = torch.Generator().manual_seed(0)
    h, w, length, lengths = 3, 4, 7, [7, 4]
    x, text = torch.randn(2, h * w, 16, generator=g), torch.randn(2, length, FEATURES, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        want = model(**pipeline_inputs(x, text, lengths, h, w, sigma)).sample[:, length:]
        mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
        embeds, text_mask = compacted(text * mask[..., None], mask)
        got = x, sigma, embeds, text_mask, torch.tensor([h, w])
        for layer in plugin.split_into_layers(model, None):
            got = layer(got)
    assert got[0].dtype == torch.float32 and got[0].shape == want.shape == (2, 12, 16)
    torch.testing.assert_close(got[0], -want, atol=1e-5, rtol=1e-5)


def test_both_layouts_load_the_same_and_stages_read_their_own(tiny_ideogram4: Path) -> None:
    from safetensors.torch import load_file

    original = load_file(str(comfy_path(tiny_ideogram4)))
    assert original["model.diffusion_model.layers.1.attention.qkv.weight"].shape == (96, 32)
    folder, single = config(tiny_ideogram4), config(tiny_ideogram4, diffusion_model=comfy_path(tiny_ideogram4))
    registry = Registry()
    assert registry.register_model("ideogram4", plugin).ok
    assert plugin.validate_model_files(single) == [] and plugin.validate_model_files(folder) == []
    a = plugin.load_diffusion_model(folder, CPU, torch.float32).state_dict()
    b = plugin.load_diffusion_model(single, CPU, torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    qkv = original["model.diffusion_model.layers.1.attention.qkv.weight"]
    assert torch.equal(qkv, torch.cat([a[f"layers.1.attention.to_{x}.weight"] for x in "qkv"]))
    for cfg in (folder, single):
        reads = assert_stages_read_their_own(registry.model("ideogram4"), cfg, stages=2)
        assert "llm_cond_proj.weight" in reads[0].tensors and "final_layer.linear.weight" in reads[1].tensors


def test_default_lora_targets_all_get_gradients(tiny_ideogram4: Path) -> None:
    import peft

    model = tiny_transformer(TinyIdeogram4Config())
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = plugin.lora_targets(config(tiny_ideogram4))
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False))
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
               for n, _ in peft_model.named_modules() if n.endswith(".lora_A.default")}
    assert adapted == {n for n in linears if n.startswith("layers.")} and len(adapted) == 16
    g = torch.Generator().manual_seed(0)
    out = torch.randn(1, 4, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 3, FEATURES, generator=g)
    out = (*out, torch.ones(1, 3, dtype=torch.bool), torch.tensor([2, 2]))
    for layer in plugin.split_into_layers(model, None):
        out = layer(out)
    out[0].square().mean().backward()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())
