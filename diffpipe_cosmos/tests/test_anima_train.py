"""Anima's one shared training run (the CLI: DeepSpeed, the real cache, peft; 1 process; LoRA on the transformer and,
with ``llm_adapter_lr``, on the LLM adapter at its own rate) trains with the loss falling and samples before its first
step; a short 2-stage run in 2 processes from its cache draws the same losses; the saved diffusers LoRA loads through
the modular pipeline's ``load_lora_weights`` (``AnimaLoraLoaderMixin``: ``transformer.`` and ``text_conditioner.``)
and reproduces the trained model; the ComfyUI file is loaded whole by ComfyUI's key map (and read by diffusers' own
Anima converter as the diffusers file), applying like the trained LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.comfy import apply_file, generic_key_map
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_cosmos.anima import anima as plugin
from diffpipe_cosmos.anima_files import adapter_table, layout_for_config
from diffpipe_cosmos.config import AnimaConfig
from diffpipe_cosmos.testing_anima import comfy_path, load_pipeline, write_tiny_anima

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, TWO_STAGE_STEPS = 4, 8.0, 20, 4
SAMPLE = {"prompts": ["a red cat"], "negative_prompt": "blurry", "cfg": 3.0, "steps": 2, "before_first_step": True}


def run_config(steps: int, stages: int = 1, sample: dict | None = SAMPLE, **top: object) -> str:
    model = {"type": "anima", "text_max_length": 16, "timestep_sample_method": "uniform", "llm_adapter_lr": 2e-2}
    top = {"max_steps": steps, "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3, **top}
    return runs.lora_run_toml(model, 1e-1, sample, RANK, ALPHA, **top)


@pytest.fixture(scope="module")
def anima_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared training run of ``anima`` through the CLI (1 process): a tiny model, 4 captioned 32x32 images,
    LoRA saved as diffusers and ComfyUI files, a CFG sample before the first step. Its run folder."""
    root = tmp_path_factory.mktemp("anima-train")
    write_tiny_anima(root / "model")
    captions = ["a red cat", "a blue dog", "a green tree", "a small house"]
    write_image_dataset(root / "data", 4, size=(32, 32), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "data", resolutions=[32], enable_ar_bucket=False)
    (root / "run.toml").write_text(run_config(STEPS))
    return runs.train(root, "run.toml", 1)


def test_trains_on_two_stages_as_on_one(anima_run: Path) -> None:
    root = anima_run.parent.parent
    (root / "run2.toml").write_text(run_config(TWO_STAGE_STEPS, 2, None))
    two = runs.train(root, "run2.toml", 2)
    runs.assert_trained_in_stages(two, TWO_STAGE_STEPS, 2)
    assert runs.losses(two) == pytest.approx(runs.losses(anima_run)[:TWO_STAGE_STEPS], rel=1e-4)


def test_the_loss_falls_and_a_sample_is_written(anima_run: Path) -> None:
    runs.assert_loss_falls(anima_run, STEPS, 5)
    names = sorted(p.name for p in (anima_run / "samples" / "step-0000000").iterdir())
    assert "00-a-red-cat.png" in names, names


def full_forward(transformer, conditioner, seed: int = 0) -> torch.Tensor:
    """The adapter, then the transformer, on fixed random inputs (two captions, one padded)."""
    g = torch.Generator().manual_seed(seed)
    qwen, ids = torch.randn(2, 5, 32, generator=g), torch.randint(0, 40, (2, 6), generator=g)
    mask_q, mask_t = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
    mask_q[1, 3:], mask_t[1, 4:] = 0, 0
    with torch.no_grad():
        text = conditioner(qwen, ids, mask_t, mask_q)
        return transformer(hidden_states=torch.randn(2, 4, 1, 4, 4, generator=g), timestep=torch.tensor([0.3, 0.7]),
                           encoder_hidden_states=text, padding_mask=torch.zeros(1, 1, 32, 32), return_dict=False)[0]


def test_diffusers_lora_loads_in_the_modular_pipeline_and_reproduces(anima_run: Path) -> None:
    model_dir, saved = anima_run.parent.parent / "model", anima_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    assert "transformer.transformer_blocks.1.ff.net.2.lora_A.weight" in state
    assert "text_conditioner.blocks.1.cross_attn.k_proj.lora_B.weight" in state
    config = validate(AnimaConfig, {"type": "anima", "path": model_dir, "dtype": "float32"}, "test")
    reference = runs.with_trained_lora(plugin.load_diffusion_model(config, torch.device("cpu"), torch.float32),
                                       anima_run, RANK, ALPHA, cfg["target_modules"])
    pipe = load_pipeline(model_dir)
    untrained = full_forward(pipe.transformer, pipe.text_conditioner)
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    got = full_forward(pipe.transformer, pipe.text_conditioner)
    runs.assert_reproduces(got, full_forward(reference, reference.text_conditioner), untrained)
    # the transformer's own loader takes the file's transformer part (documented for a transformer-only LoRA)
    from diffusers import CosmosTransformer3DModel

    transformer = CosmosTransformer3DModel.from_pretrained(str(model_dir / "transformer"))
    transformer.load_lora_adapter(str(saved / "adapter_model.safetensors"), prefix="transformer")
    torch.testing.assert_close(full_forward(transformer, reference.text_conditioner),
                               full_forward(reference, reference.text_conditioner), atol=1e-5, rtol=1e-5)


def test_comfyui_lora_is_loaded_whole_by_comfyuis_key_map(anima_run: Path) -> None:
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_anima_lora_to_diffusers

    saved = anima_run / "saved" / "final"
    comfy = load_file(str(saved / "adapter_model.comfyui.safetensors"))
    assert "diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight" in comfy
    assert "diffusion_model.llm_adapter.blocks.1.mlp.2.lora_B.weight" in comfy
    # diffusers' own Anima converter reads it as the diffusers file
    converted = _convert_non_diffusers_anima_lora_to_diffusers({k: v for k, v in comfy.items() if ".alpha" not in k})
    diffusers_file = load_file(str(saved / "adapter_model.safetensors"))
    assert converted.keys() == diffusers_file.keys()
    base = load_file(str(comfy_path(anima_run.parent.parent / "model")))
    native = {k.removeprefix("net."): v for k, v in base.items()}
    got = apply_file({f"diffusion_model.{k}": v for k, v in native.items()}, comfy, generic_key_map(native))
    got = {f"net.{k.removeprefix('diffusion_model.')}": v for k, v in got.items()}
    config = json_config(anima_run.parent.parent / "model")
    weights = layout_for_config(config).to_model(base)
    weights.update({f"text_conditioner.{k}": v for k, v in adapter_table().to_model(base).items()})
    merged = layout_for_config(config).to_model(got)
    merged.update({f"text_conditioner.{k}": v for k, v in adapter_table().to_model(got).items()})
    params = runs.checkpoint_params(anima_run)
    runs.assert_state_close(merged, runs.merge_peft(weights, params, ALPHA / RANK), atol=1e-5)
    modules = {k.split(".lora_A.")[0] for k in params if ".lora_A." in k}
    assert sum(not torch.equal(merged[k], weights[k]) for k in weights) == len(modules)


def json_config(model_dir: Path) -> dict:
    import json

    return json.loads((model_dir / "transformer" / "config.json").read_text())
