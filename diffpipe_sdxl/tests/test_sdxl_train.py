"""End-to-end through the real CLI (DeepSpeed on gloo): cache and train the tiny SDXL fully with 1 stage from the
diffusers folder, and a LoRA with 2 pipeline stages from the single-file checkpoint; then load the saved LoRA, in
diffusers and kohya formats, through diffusers' ``StableDiffusionXLPipeline.load_lora_weights``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
from safetensors.torch import load_file

from diffpipe_core.adapters import read_adapter
from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.testing import runs
from diffpipe_core.testing.golden import assert_matches
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_sdxl.plugin import LORA_TARGETS

pytestmark = pytest.mark.slow

RUN_TOML = """
output_dir = "out"
dataset = "dataset.toml"
max_steps = {steps}
micro_batch_size_per_gpu = 2
gradient_accumulation_steps = 2
pipeline_stages = {stages}
seed = 11
save_dtype = "float32"

[model]
type = "sdxl"
dtype = "float32"
max_prompt_chunks = 2
{model}

[optimizer]
lr = {lr}
{adapter}"""
FULL = 'save_model_formats = ["diffusers", "single_file"]\n'

ADAPTER = """
[adapter]
rank = 4
alpha = 8
save_formats = ["diffusers", "kohya"]
"""

# Samples during the shared golden 2-stage run (issue 21): the base model before the first step, then at step 4.
SAMPLE = {"prompts": '["a red cat"]', "before_first_step": "true", "every_n_steps": 4, "steps": 3, "seed": 5}
SAMPLE_TABLE = "\n[sample]\n" + "".join(f"{key} = {value}\n" for key, value in {**SAMPLE, "resolution": 64}.items())


def make_project(
    root: Path, tiny: tuple[Path, Path], stages: int, steps: int, single_file: bool, lora: bool, **more: str
) -> Path:
    """The tiny project (data and run.toml) in ``root``; ``more``: ``model`` (more ``[model]`` keys), ``tables``."""
    folder, file = tiny
    root.mkdir(parents=True, exist_ok=True)
    # mixed sizes: the 96x64 ones are center-cropped into the 64x64 bucket
    write_image_dataset(root / "images", 8, size=[(64, 64), (96, 64)] * 4)
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64], enable_ar_bucket=False)
    model = f'path = "{file}"\nconfig_path = "{folder}"' if single_file else f'path = "{folder}"'
    toml = RUN_TOML.format(
        steps=steps,
        stages=stages,
        model=model + more.get("model", ""),
        lr=5e-3 if lora else 1e-3,
        adapter=ADAPTER if lora else "",
    )
    (root / "run.toml").write_text((toml if lora else FULL + toml) + more.get("tables", ""))
    return root / "run.toml"


def train(root: Path, tiny: tuple[Path, Path], stages: int, steps: int, single_file: bool, lora: bool) -> Path:
    return runs.train(root, make_project(root, tiny, stages, steps, single_file, lora), procs=stages, timeout=400)


GOLDEN = Path(__file__).parent / "golden"  # saved/final of these runs (golden.py: bytes, or values on another CPU)


@pytest.fixture(scope="module")
def one_stage(tiny_sdxl: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Full fine-tuning, 1 process, from the diffusers folder."""
    return train(tmp_path_factory.mktemp("one_stage"), tiny_sdxl, stages=1, steps=10, single_file=False, lora=False)


@pytest.fixture(scope="module")
def two_stages(sdxl_two_stages: Path) -> Path:
    """LoRA, 2 pipeline stages, from the single-file checkpoint; shared, see conftest.py."""
    return sdxl_two_stages


def test_loss_falls_and_two_stages_match_one(one_stage: Path, two_stages: Path) -> None:
    assert sorted(train_losses(one_stage)) == list(range(1, 11)) and sorted(train_losses(two_stages)) == [1, 2, 3, 4]
    one, two = runs.assert_loss_falls(one_stage, 10, 3), runs.losses(two_stages)
    # Same seed, same weights (folder vs single file), same data, and a fresh LoRA (lora_B = 0) leaves the UNet
    # unchanged: the first step's loss must not depend on the pipeline split or the load path.
    assert two[0] == pytest.approx(one[0], rel=1e-5)
    # gradients crossed the stage boundary: the LoRA weights of both stages were trained
    ckpt = sorted((two_stages / "checkpoints").glob("step-*"))[-1]
    assert runs.stage_files(two_stages) == ["params-stage0.safetensors", "params-stage1.safetensors"]
    for stage in (0, 1):
        trained = load_file(str(ckpt / f"params-stage{stage}.safetensors"))
        lora_b = [v for k, v in trained.items() if "lora_B" in k]
        assert lora_b and all(v.abs().max() > 0 for v in lora_b), f"stage {stage}"


def test_saved_lora_files_are_the_golden_ones(two_stages: Path) -> None:
    assert_matches(two_stages / "saved" / "final", GOLDEN / "two_stages.json")


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([100, 800])
    text, pooled = torch.randn(2, 77, 64, generator=g), torch.randn(2, 32, generator=g)
    time_ids = torch.tensor([[64.0, 96, 0, 16, 64, 64]] * 2)
    return x, t, text, pooled, time_ids


def _run(unet: torch.nn.Module) -> torch.Tensor:
    x, t, text, pooled, time_ids = _inputs()
    with torch.no_grad():
        return unet(x, t, text, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample


@pytest.fixture(scope="module")
def trained_outputs(two_stages: Path, tiny_sdxl: tuple[Path, Path]) -> torch.Tensor:
    """The trained UNet's outputs, rebuilt from the checkpoint's trainable tensors (all stages) with peft."""
    trained = UNet2DConditionModel.from_pretrained(tiny_sdxl[0], subfolder="unet", local_files_only=True)
    untrained = _run(trained)
    expected = _run(runs.with_trained_lora(trained, two_stages, 4, 8, LORA_TARGETS))
    assert (expected - untrained).abs().max() > 1e-3, "training did not change the UNet"
    return expected


def _assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (got - expected).abs().max()
    assert err < 1e-4 * max(1.0, expected.abs().max().item()), f"{what}: max error {err}"


def test_saved_lora_key_layouts(two_stages: Path) -> None:
    saved = two_stages / "saved" / "final"
    state, cfg = read_adapter(saved)
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 4  # the trained alpha 8 is folded into lora_B
    assert "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight" in state
    assert all(k.startswith("unet.") and ".lora_" in k for k in state)
    kohya = load_file(str(saved / "adapter_model.kohya.safetensors"))
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya
    assert "lora_unet_output_blocks_0_1_transformer_blocks_1_ff_net_2.lora_up.weight" in kohya
    assert float(kohya["lora_unet_middle_block_1_transformer_blocks_0_attn2_to_k.alpha"]) == 4.0
    assert len(kohya) == len(state) * 3 // 2  # down, up and alpha per module


def test_kohya_lora_reproduces_the_trained_unet_in_diffusers(
    two_stages: Path, tiny_sdxl: tuple[Path, Path], trained_outputs: torch.Tensor
) -> None:
    """diffusers converts the SGM-named kohya keys itself; alpha comes from the .alpha tensors."""
    kohya = load_file(str(two_stages / "saved" / "final" / "adapter_model.kohya.safetensors"))
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl[0], local_files_only=True)
    pipe.load_lora_weights(kohya)
    _assert_close(_run(pipe.unet.eval()), trained_outputs, "kohya")


def test_diffusers_lora_reproduces_the_trained_unet_in_diffusers(
    two_stages: Path, tiny_sdxl: tuple[Path, Path], trained_outputs: torch.Tensor
) -> None:
    """The PEFT-format tensors passed as a dict, without metadata: diffusers infers rank and alpha = rank, and the
    trained strength alpha / rank = 2 is already in the tensors (nothing to set)."""
    state, cfg = read_adapter(two_stages / "saved" / "final")
    assert cfg["lora_alpha"] == cfg["r"]
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl[0], local_files_only=True)
    pipe.load_lora_weights(state, adapter_name="trained")
    _assert_close(_run(pipe.unet.eval()), trained_outputs, "diffusers")


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_model.kohya.safetensors"])
def test_saved_files_load_by_path(
    name: str, two_stages: Path, tiny_sdxl: tuple[Path, Path], trained_outputs: torch.Tensor
) -> None:
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl[0], local_files_only=True)
    if name == "adapter_model.safetensors":  # every tensor lands unchanged, nothing left over
        runs.load_lora_into(pipe, two_stages / "saved" / "final" / name)
    else:
        pipe.load_lora_weights(str(two_stages / "saved" / "final"), weight_name=name)
    _assert_close(_run(pipe.unet.eval()), trained_outputs, name)


def test_full_finetune_exports_load_in_diffusers(one_stage: Path, tiny_sdxl: tuple[Path, Path]) -> None:
    """The run's save_model_formats: the saved full fine-tune as an original-layout single file and as a diffusers
    UNet folder, written by the plugin's export_model beside the shards, loads back through diffusers with exactly
    the trained weights (and the base VAE / text encoders)."""
    folder = tiny_sdxl[0]
    saved = one_stage / "saved" / "final"
    trained: dict[str, torch.Tensor] = {}
    for shard in saved.glob("model-*.safetensors"):
        trained.update(load_file(str(shard)))
    pipe = StableDiffusionXLPipeline.from_single_file(
        str(saved / "single_file" / "sdxl.safetensors"), config=str(folder), local_files_only=True
    )
    from_folder = UNet2DConditionModel.from_pretrained(saved / "diffusers" / "unet", local_files_only=True)
    base = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
    for unet in (pipe.unet, from_folder):
        state = unet.state_dict()
        assert state.keys() == trained.keys()
        assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert not torch.equal(base.unet.state_dict()["conv_out.weight"], trained["conv_out.weight"])
    for name in ("vae", "text_encoder", "text_encoder_2"):
        a, b = getattr(pipe, name).state_dict(), getattr(base, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b), name
