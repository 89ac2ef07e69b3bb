"""FLUX.3's layers chained equal ``Flux3Transformer2DModel.forward`` (the base model and the flow map, captions of
one window and of mixed windows); BFL's layout is diffusers' own conversion, the single file and the folder load the
same weights and each stage reads only its own tensors; the default LoRA targets all get gradients; the training
shift is the pipeline scheduler's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.config import Flux3Config
from diffpipe_flux.flux3 import flux3
from diffpipe_flux.flux3_layers import image_ids, text_ids
from diffpipe_flux.testing_flux3 import TinyFlux3Config, bfl_path, tiny_transformer

CPU = torch.device("cpu")
H, W = 2, 3


def config(path: Path, **extra):
    return validate(Flux3Config, {"type": "flux3", "path": path, "dtype": "float32", **extra}, "test")


def chained(model, x, t, text, valid, target=None) -> torch.Tensor:
    out = (x, t, text, valid, torch.tensor([H, W]), *(() if target is None else (target,)))
    for layer in flux3.split_into_layers(model, None):
        out = layer(out)
    assert out[0].dtype == torch.float32
    return out[0]


def forward(model, x, t, text, target=None) -> torch.Tensor:
    extra = {} if target is None else {"target_timestep": target}
    return model(hidden_states=x, encoder_hidden_states=text, timestep=t, img_ids=image_ids(H, W),
                 txt_ids=text_ids(text.shape[1]), **extra).sample


@pytest.mark.parametrize("flow_map", [False, True])
def test_layers_chained_equal_the_forward(flow_map: bool) -> None:
    model = tiny_transformer(TinyFlux3Config(flow_map=flow_map)).eval()
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, H * W, 16, generator=g), torch.randn(2, 7, 256, generator=g)
    t, target = torch.tensor([0.3, 0.8]), (torch.tensor([0.1, 0.5]) if flow_map else None)
    with torch.no_grad():
        # one window for both captions: the block's own path
        want = forward(model, x, t, text, target)
        got = chained(model, x, t, text, torch.ones(2, 7, dtype=torch.bool), target)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # the second caption's window is 4 tokens: its row equals the forward on those 4 alone
        valid = torch.ones(2, 7, dtype=torch.bool)
        valid[1, 4:] = False
        got = chained(model, x, t, text, valid, target)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        alone = forward(model, x[1:], t[1:], text[1:, :4], None if target is None else target[1:])
        torch.testing.assert_close(got[1:], alone, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(alone, want[1:], atol=1e-3)  # the padding counts: masking it is not a no-op


def test_bfl_layout_is_diffusers_conversion(tiny_flux3: Path, tiny_flux3_distilled: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    from diffpipe_flux.flux3_keys import layout_for_config

    for folder in (tiny_flux3, tiny_flux3_distilled):
        original = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(str(bfl_path(folder))).items()}
        assert "early_stream_modulations.image.lin.weight" in original
        assert ("ref_time_in.in_layer.weight" in original) == (folder == tiny_flux3_distilled)
        model = flux3.load_diffusion_model(config(folder), CPU, torch.float32).state_dict()
        converted = convert_flux3_transformer_checkpoint_to_diffusers(dict(original))
        assert converted.keys() == model.keys() and all(torch.equal(converted[k], model[k]) for k in model)
        # BFL's training-only REPA heads are dropped on read, as diffusers drops them
        table = layout_for_config(flux3.model_folder_config(config(folder)))
        extra = {**original, "repa_projectors.0.weight": torch.zeros(2, 2)}
        assert table.to_model(extra).keys() == model.keys()


def test_both_layouts_load_the_same_and_stages_read_their_own(tiny_flux3: Path) -> None:
    folder, single = config(tiny_flux3), config(tiny_flux3, diffusion_model=bfl_path(tiny_flux3))
    registry = Registry()
    assert registry.register_model("flux3", flux3).ok
    assert flux3.validate_model_files(single) == [] and flux3.validate_model_files(folder) == []
    a = flux3.load_diffusion_model(folder, CPU, torch.float32).state_dict()
    b = flux3.load_diffusion_model(single, CPU, torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for cfg in (folder, single):
        reads = assert_stages_read_their_own(registry.model("flux3"), cfg, stages=2)
        assert "context_embedder.weight" in reads[0].tensors and "proj_out.weight" in reads[1].tensors


@pytest.mark.parametrize("flow_map", [False, True])
def test_default_lora_targets_all_get_gradients(tiny_flux3: Path, flow_map: bool) -> None:
    import peft

    model = tiny_transformer(TinyFlux3Config(flow_map=flow_map))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "blocks" in n}
    targets = flux3.lora_targets(config(tiny_flux3))
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False))
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
               for n, _ in peft_model.named_modules() if n.endswith(".lora_A.default")}
    assert adapted == {n for n in linears if not n.startswith("mode_blocks.image_cond.")}
    g = torch.Generator().manual_seed(0)
    valid = torch.ones(1, 3, dtype=torch.bool)
    t = torch.tensor([0.5])
    out = chained(model, torch.randn(1, H * W, 16, generator=g), t, torch.randn(1, 3, 256, generator=g), valid,
                  t if flow_map else None)
    out.square().mean().backward()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())


def test_the_training_shift_is_the_pipelines(tiny_flux3: Path) -> None:
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3SetTimestepsStep

    assert flux3.training_shift(config(tiny_flux3)) == pytest.approx(Flux3SetTimestepsStep().shift)
    assert flux3.training_shift(config(tiny_flux3, scheduler_shift=False, shift=3.0)) == 3.0


def test_a_text_encoder_that_does_not_fit_is_named(tiny_flux3: Path, tmp_path: Path) -> None:
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_flux3, other)
    file = other / "text_encoder" / "config.json"
    te = json.loads(file.read_text())
    for key, value, said in (("hidden_size", 64, "joint_attention_dim is 256"),
                             ("num_hidden_layers", 28, "needs at least 32 layers")):
        changed = {**te, "text_config": {**te["text_config"], key: value}}
        file.write_text(json.dumps(changed))
        [problem] = flux3.validate_model_files(config(other))
        assert f"{file}: text_config.{key} is {value}" in problem and said in problem, problem
