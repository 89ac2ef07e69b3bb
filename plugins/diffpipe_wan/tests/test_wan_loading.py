"""Issue test 1: both on-disk layouts (a diffusers folder, an original-layout single file over it) load to the same
weights, for text-to-video, image-to-video and an A14B expert; per-stage loading reads only the rank's own tensors
from either layout; the layers chained compute the diffusers transformer; the original layout is the one diffusers'
own converter reads; bad folders and settings are reported by name before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.registry import get_registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_wan.i2v import wan_i2v
from diffpipe_wan.plugin import wan
from diffpipe_wan.testing import single_file_path

CPU = torch.device("cpu")


def config(plugin, path: Path, **kw):
    table = {"type": plugin.spec.name, "path": path, "dtype": "float32", "encoder_dtype": "float32", **kw}
    return validate(plugin.spec.config_schema, table, "test")


def folder_weights(path: Path, component: str = "transformer") -> dict[str, torch.Tensor]:
    return load_file(str(path / component / "diffusion_pytorch_model.safetensors"))


@pytest.mark.parametrize(
    ("fixture", "plugin", "component"),
    [
        ("tiny_wan", wan, "transformer"),
        ("tiny_wan_i2v", wan_i2v, "transformer"),
        ("tiny_wan_a14b", wan, "transformer_2"),
    ],
)
def test_both_layouts_load_the_same_weights(request, fixture: str, plugin, component: str) -> None:
    path = request.getfixturevalue(fixture)
    expert = {"expert": "low" if component == "transformer_2" else "high"} if "a14b" in fixture else {}
    folder = plugin.load_diffusion_model(config(plugin, path, **expert), CPU, torch.float32).state_dict()
    single_file = single_file_path(path, component)
    single = plugin.load_diffusion_model(
        config(plugin, path, diffusion_model=single_file, **expert), CPU, torch.float32
    ).state_dict()
    expected = folder_weights(path, component)  # the trained component's weights, not the other expert's
    assert folder.keys() == single.keys() == expected.keys() and len(expected) > 50
    for key in expected:
        assert torch.equal(folder[key], expected[key]) and torch.equal(single[key], expected[key]), key
    original = set(load_file(str(single_file)))  # really the original layout
    assert {"head.modulation", "head.head.weight", "blocks.1.modulation", "blocks.0.self_attn.q.weight"} <= original
    assert {
        "blocks.0.ffn.0.weight",
        "blocks.0.norm3.weight",
        "time_projection.1.weight",
        "patch_embedding.weight",
    } <= original
    assert not any("attn1" in k or "to_q" in k or "condition_embedder" in k for k in original)
    if fixture == "tiny_wan_i2v":
        assert {
            "blocks.0.cross_attn.k_img.weight",
            "blocks.0.cross_attn.norm_k_img.weight",
            "img_emb.proj.1.weight",
        } <= original


def test_original_layout_is_what_diffusers_converts(tiny_wan_i2v: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    ours = folder_weights(tiny_wan_i2v)
    theirs = convert_wan_transformer_to_diffusers(dict(load_file(str(single_file_path(tiny_wan_i2v)))))
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_tensors(tiny_wan_a14b: Path, layout: str) -> None:
    extra = {"diffusion_model": single_file_path(tiny_wan_a14b, "transformer_2")} if layout == "original" else {}
    cfg = config(wan, tiny_wan_a14b, expert="low", **extra)
    stages = assert_stages_read_their_own(get_registry().model("wan"), cfg, stages=2)
    first, second = (set(s.tensors) for s in stages)
    assert "patch_embedding.weight" in first and "blocks.0.attn1.to_q.weight" in first
    assert "proj_out.weight" in second and "scale_shift_table" in second and "blocks.1.ffn.net.2.weight" in second
    if layout == "original":
        assert "blocks.0.self_attn.q.weight" in stages[0].reads and "head.modulation" in stages[1].reads


def run_layers(plugin, model, cfg, inputs: tuple) -> torch.Tensor:
    for layer in plugin.split_into_layers(model, cfg):
        inputs = layer(inputs)
    return inputs[0]


def test_layers_compute_the_transformer(tiny_wan: Path, tiny_wan_i2v: Path) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.rand(2, generator=g)
    cfg = config(wan, tiny_wan)
    model = wan.load_diffusion_model(cfg, CPU, torch.float32)
    x, text = torch.randn(2, 4, 3, 4, 6, generator=g), torch.randn(2, 16, 32, generator=g)
    with torch.no_grad():
        want = model(hidden_states=x, timestep=t * 1000, encoder_hidden_states=text).sample
        assert torch.equal(run_layers(wan, model, cfg, (x, t, text)), want)

    cfg = config(wan_i2v, tiny_wan_i2v)
    model = wan_i2v.load_diffusion_model(cfg, CPU, torch.float32)
    x, text, image = torch.randn(2, 12, 3, 4, 6, generator=g), torch.randn(2, 512, 32), torch.randn(2, 5, 16)
    with torch.no_grad():
        want = model(x, t * 1000, text, encoder_hidden_states_image=image).sample
        assert torch.equal(run_layers(wan_i2v, model, cfg, (x, t, text, image)), want)


def test_bad_folders_and_settings_are_named(
    tiny_wan: Path, tiny_wan_a14b: Path, tiny_wan_i2v: Path, tiny_wan_ti2v: Path, tmp_path: Path
) -> None:
    assert wan.validate_model_files(config(wan, tiny_wan)) == []
    assert wan.validate_model_files(config(wan, tiny_wan_a14b)) == []  # expert = "both", the A14B default
    high_file = single_file_path(tiny_wan_a14b)
    (problem,) = wan.validate_model_files(config(wan, tiny_wan_a14b, diffusion_model=high_file))
    assert problem == (
        f"{tiny_wan_a14b / 'model_index.json'}: [model] diffusion_model is set but diffusion_model_2 is not: expert = "
        '"both" (the default for this A14B folder, boundary_ratio 0.875) trains both transformers; give '
        "diffusion_model (transformer, the high_noise file) and diffusion_model_2 (transformer_2, the low_noise "
        'file), or neither, or set expert = "high" or "low" to train the one file'
    )
    (problem,) = wan.validate_model_files(config(wan, tiny_wan_a14b, expert="low", diffusion_model_2=high_file))
    assert "diffusion_model_2 = " in problem and "this run trains expert 'low': leave it out" in problem
    (problem,) = wan.validate_model_files(config(wan, tiny_wan_a14b, expert="high", expert_lr={"low": 1e-5}))
    assert problem.startswith("[model] expert_lr = {'low': 1e-05} sets the learning rates of an expert = \"both\"")
    assert "this run trains 'high' alone: leave expert_lr out" in problem
    (problem,) = wan.validate_model_files(config(wan, tiny_wan, expert="low"))
    assert "expert = 'low' is for Wan 2.2 A14B folders" in problem and "leave expert out" in problem
    (problem,) = wan.validate_model_files(config(wan, tiny_wan_a14b, expert="low", min_t=0.9))
    assert problem.endswith("min_t (0.9) must be below max_t (0.875, the model default)")
    (problem,) = wan_i2v.validate_model_files(config(wan_i2v, tiny_wan_i2v, text_max_length=16))
    assert "attends to exactly 512 text tokens" in problem and "text_max_length = 512 (now 16)" in problem
    (problem,) = wan.validate_model_files(config(wan, tiny_wan_i2v))
    assert "the pipeline is 'WanImageToVideoPipeline'" in problem and "model 'wan' expects 'WanPipeline'" in problem
    ti2v_as_i2v = tmp_path / "ti2v"
    shutil.copytree(tiny_wan_ti2v, ti2v_as_i2v)
    index = json.loads((ti2v_as_i2v / "model_index.json").read_text())
    (ti2v_as_i2v / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    (problem,) = wan_i2v.validate_model_files(config(wan_i2v, ti2v_as_i2v))
    assert "expand_timesteps is set: a Wan 2.2 TI2V folder" in problem and 'type = "wan-ti2v"' in problem
    shutil.rmtree(ti2v_as_i2v / "vae")
    (problem,) = wan_i2v.validate_model_files(config(wan_i2v, ti2v_as_i2v))
    assert problem == f"{ti2v_as_i2v / 'vae'}: missing; expected the vae ('AutoencoderKLWan')"
    (problem,) = wan.validate_model_files(
        config(wan, tiny_wan, diffusion_model=tiny_wan / "vae" / "diffusion_pytorch_model.safetensors")
    )
    assert "no 'head.modulation' among its" in problem and "in the original Wan key layout" in problem
