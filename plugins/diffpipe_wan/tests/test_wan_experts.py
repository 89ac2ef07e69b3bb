"""Wan 2.2 A14B's two experts in one run (issue 41, ``[model] expert = "both"``, the default for an A14B folder).

In-process: each sample's time decides its expert at ``boundary_ratio``, a micro-batch mixing both gives every
sample exactly its own expert's prediction, and an expert without samples gets no gradient; samples switch expert
where ``WanPipeline`` does and equal its output. Through the real CLI, one shared 2-stage run (2 processes, LoRA,
``expert_lr``): each expert's LoRA is saved in its own folder, labelled in its files' metadata and
``adapter_config.json`` and named in the run's summary, both load into ``WanPipeline`` (``transformer`` and
``transformer_2``) and reproduce the trained experts; the run resumed from its middle checkpoint repeats every
loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors import safe_open

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml
from diffpipe_core.testing.processes import run_diffpipe
from diffpipe_core.types import TrainingContext
from diffpipe_wan.plugin import boundary_ratio, expert_of, wan
from diffpipe_wan.testing import TinyWanConfig, write_clips, write_tiny_wan

BOUNDARY, RANK, ALPHA, STEPS = 0.875, 4, 8.0, 4
CPU = torch.device("cpu")
FOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}


def _config(folder: Path):
    table = {"type": "wan", "path": folder, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 8}
    return validate(wan.spec.config_schema, table, "test")


def _chained(layers, inputs):
    out = inputs
    for layer in layers:
        out = layer(out)
    return out[0]


def test_each_sample_trains_the_expert_of_its_time(tiny_wan_a14b: Path) -> None:
    cfg = _config(tiny_wan_a14b)
    assert expert_of(cfg) == "both" and boundary_ratio(tiny_wan_a14b) == BOUNDARY
    model = wan.load_diffusion_model(cfg, CPU, torch.float32)
    layers = wan.split_into_layers(model, cfg)
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(6, 4, 2, 4, 4, generator=g), "text_embeds": torch.randn(6, 8, 32, generator=g)}
    context = TrainingContext(model_config=cfg)
    inputs, targets = wan.prepare_inputs(batch, context, torch.Generator().manual_seed(1))
    x, t, text, expert = inputs
    assert torch.equal(expert, (t < BOUNDARY).long())  # 0: transformer (t >= boundary), 1: transformer_2
    assert 0 < int(expert.sum()) < len(t), t  # this micro-batch mixes both experts

    pred = _chained(layers, inputs)  # every sample through its own expert's layers, back in batch order
    for i in range(len(t)):
        single = model if expert[i] == 0 else model.transformer_2
        want = single(x[i : i + 1], t[i : i + 1] * 1000, text[i : i + 1], return_dict=False)[0]
        torch.testing.assert_close(pred[i : i + 1], want, rtol=1e-5, atol=1e-6)

    high = (expert == 0).nonzero().squeeze(1)  # a micro-batch of high-noise samples only
    only_high = tuple(v.index_select(0, high) for v in inputs)
    torch.nn.functional.mse_loss(_chained(layers, only_high), targets[0].index_select(0, high)).backward()
    assert all(p.grad is None for p in model.transformer_2.parameters())
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("blocks."))


def test_samples_switch_expert_at_the_boundary_as_wan_pipeline(tiny_wan_a14b: Path) -> None:
    from diffusers import WanPipeline
    from test_wan_sampling import pipeline_latents, sample

    from diffpipe_core.sampling.schedules import stepped_schedule

    cfg = _config(tiny_wan_a14b)
    schedule = stepped_schedule(tiny_wan_a14b, 3)
    sides = {bool(v >= BOUNDARY * 1000) for v in schedule.diffpipe_scheduler.timesteps}
    assert sides == {True, False}  # the 3 steps run both experts
    ours, texts, _ = sample(wan, cfg, 3.0)
    pipe = WanPipeline.from_pretrained(str(tiny_wan_a14b), torch_dtype=torch.float32, local_files_only=True)
    assert pipe.config.boundary_ratio == BOUNDARY
    expected = pipeline_latents(pipe, texts, 3.0)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    pipe.register_to_config(boundary_ratio=None)  # one expert for every step: a different sample
    assert (pipeline_latents(pipe, texts, 3.0) - expected).abs().max() > 1e-3


def _train(root: Path, *args: str) -> str:
    result = run_diffpipe(["train", "--config", str(root / "run.toml"), "--num-procs", "2", *args], cwd=root,
                          timeout=600, env=runs.cli_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.output[-4000:]
    return result.output


@pytest.fixture(scope="module")
def both_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float], str]:
    """The shared run: both experts of a tiny A14B folder, LoRA, 2 stages in 2 processes, 4 steps of 2 micro-batches
    of 2 clips, the low-noise expert at half the learning rate, a checkpoint at step 2; then resumed from it. Returns
    the run folder, the uninterrupted run's losses and its printed output."""
    root = tmp_path_factory.mktemp("wan-both")
    write_tiny_wan(root / "model", TinyWanConfig(boundary_ratio=BOUNDARY))
    write_clips(root / "media", ["a red car moving", "a river in a city", "a dog running", "a bright sky"], 5,
                (32, 32))
    write_dataset_toml(root / "dataset.toml", root / "media", resolutions=[32], enable_ar_bucket=False,
                       frame_buckets=[5])
    model = {"type": "wan", "text_max_length": 8, "expert_lr": {"low": 5e-3}}
    top = {"max_steps": STEPS, "pipeline_stages": 2, "partition_split": [2], "gradient_accumulation_steps": 2}
    top |= {"checkpoint_every_n_steps": 2, "seed": 3}
    (root / "run.toml").write_text(runs.lora_run_toml(model, 1e-2, rank=RANK, alpha=ALPHA, **top))
    output = _train(root)
    [run] = [p for p in (root / "out").iterdir() if p.is_dir()]
    first = train_losses(run)
    assert "resuming" in _train(root, "--resume", str(run / "checkpoints" / "step-0000002"))
    return run, first, output


@pytest.mark.slow
def test_resumed_both_experts_run_repeats_every_loss(both_run) -> None:
    run, first, _ = both_run
    runs.assert_trained_in_stages(run, STEPS, 2)
    assert sorted(first) == list(range(1, STEPS + 1))
    assert train_losses(run) == first  # exactly: float equality of every step's loss


@pytest.mark.slow
def test_each_expert_is_saved_and_labelled_on_its_own(both_run) -> None:
    run, _, output = both_run
    saved = run / "saved" / "final"
    assert sorted(p.name for p in saved.iterdir()) == sorted(FOLDERS)
    for folder, component in FOLDERS.items():
        files = sorted(p.name for p in (saved / folder).iterdir())
        assert files == ["adapter_config.json", "adapter_model.comfyui.safetensors", "adapter_model.safetensors"]
        config = json.loads((saved / folder / "adapter_config.json").read_text())
        assert (config["diffpipe.expert"], config["diffpipe.component"]) == (folder, component)
        for name in files[1:]:
            with safe_open(str(saved / folder / name), framework="pt") as f:
                meta, keys = f.metadata(), list(f.keys())
            assert (meta["diffpipe.expert"], meta["diffpipe.component"]) == (folder, component), name
            prefix = "transformer." if name == "adapter_model.safetensors" else "diffusion_model.blocks."
            assert keys and all(k.startswith(prefix) for k in keys), keys[:3]
        assert f"final/{folder}: {config['diffpipe.part']}" in output  # the run's summary names each file
    assert "0-1 (ExpertEmbed, ExpertBlocks)" in output  # both experts' layers on every stage
    assert "high-noise expert (transformer, t >= 0.875" in output
    assert "low-noise expert (transformer_2, t < 0.875" in output


@pytest.mark.slow
def test_each_expert_lora_reproduces_its_trained_expert_in_wan_pipeline(both_run) -> None:
    from diffusers import WanPipeline

    run = both_run[0]
    params = runs.checkpoint_params(run)
    low = {k[len("transformer_2."):]: v for k, v in params.items() if k.startswith("transformer_2.")}
    high = {k: v for k, v in params.items() if not k.startswith("transformer_2.")}
    assert low and high and low.keys() == high.keys()
    model_dir = run.parent.parent / "model"
    pipe = WanPipeline.from_pretrained(str(model_dir), local_files_only=True)
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(2, 4, 2, 4, 4, generator=g), "timestep": torch.tensor([950.0, 400.0]),
              "encoder_hidden_states": torch.randn(2, 8, 32, generator=g)}
    untrained = {c: runs.outputs(getattr(pipe, c), inputs) for c in FOLDERS.values()}
    saved = run / "saved" / "final"
    pipe.load_lora_weights(str(saved / "high_noise"), weight_name="adapter_model.safetensors", adapter_name="high")
    pipe.load_lora_weights(str(saved / "low_noise"), weight_name="adapter_model.safetensors", adapter_name="low",
                           load_into_transformer_2=True)
    targets = json.loads((saved / "high_noise" / "adapter_config.json").read_text())["target_modules"]
    for component, trained in (("transformer", high), ("transformer_2", low)):
        reference = WanTransformer3DModel.from_pretrained(str(model_dir / component))
        apply_lora(reference, lora_config(RANK, ALPHA, 0.0, targets))
        missing, unexpected = reference.load_state_dict(trained, strict=False)
        assert not unexpected and not [k for k in missing if "lora_" in k]
        got = runs.outputs(getattr(pipe, component), inputs)
        runs.assert_reproduces(got, runs.outputs(reference.eval(), inputs), untrained[component])


def test_both_experts_load_from_their_two_files_as_from_the_folder(tiny_wan_a14b: Path) -> None:
    """``diffusion_model`` (high noise) and ``diffusion_model_2`` (low noise), ComfyUI's pair of A14B files: the same
    weights as the folder's two transformers, whole and per stage (the low one's tensors named ``transformer_2.``)."""
    from diffpipe_wan.testing import single_file_path

    folder = wan.load_diffusion_model(_config(tiny_wan_a14b), CPU, torch.float32).state_dict()
    files = {"diffusion_model": single_file_path(tiny_wan_a14b), "diffusion_model_2": single_file_path(
        tiny_wan_a14b, "transformer_2")}
    cfg = _config(tiny_wan_a14b).model_copy(update=files)
    assert wan.validate_model_files(cfg) == []
    got = wan.load_diffusion_model(cfg, CPU, torch.float32).state_dict()
    assert got.keys() == folder.keys() and any(k.startswith("transformer_2.") for k in got)
    assert all(torch.equal(got[k], folder[k]) for k in got)
    vae = tiny_wan_a14b / "vae" / "diffusion_pytorch_model.safetensors"
    (problem,) = wan.validate_model_files(cfg.model_copy(update={"diffusion_model_2": vae}))
    assert str(vae) in problem and "no 'head.modulation' among its" in problem  # the low-noise file is checked too
    mapped = {}
    for file, key_map in wan.diffusion_model_weights(model_config=cfg):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key_map(key)
                if isinstance(name, str):
                    mapped[name] = f.get_tensor(key)
    assert mapped.keys() == folder.keys() and all(torch.equal(mapped[k], folder[k]) for k in folder)


def test_a_full_fine_tune_of_both_exports_one_model_per_expert(tiny_wan_a14b: Path, tmp_path: Path) -> None:
    """The saved shards of both experts (one model, ``transformer_2.`` the low-noise one) as a diffusers folder and an
    original-layout file per expert, labelled; the two files load back as ``diffusion_model`` and
    ``diffusion_model_2``."""
    cfg = _config(tiny_wan_a14b)
    state = {k: v + 0.01 * (i % 3) for i, (k, v) in enumerate(
        wan.load_diffusion_model(cfg, CPU, torch.float32).state_dict().items())}  # "trained": moved a little
    saved = runs.write_saved_model(state, tmp_path / "saved")
    for fmt in ("diffusers", "single_file"):
        assert wan.export_model(saved_dir=saved, model_config=cfg, out_dir=tmp_path / fmt, format=fmt) is True
    for folder, component in FOLDERS.items():
        got = WanTransformer3DModel.from_pretrained(str(tmp_path / "diffusers" / folder)).state_dict()
        low = {k[len("transformer_2."):]: v for k, v in state.items() if k.startswith("transformer_2.")}
        high = {k: v for k, v in state.items() if not k.startswith("transformer_2.")}
        want = low if component == "transformer_2" else high
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        for file in (tmp_path / "diffusers" / folder / "diffusion_pytorch_model.safetensors",
                     tmp_path / "single_file" / folder / wan.single_file_name):
            with safe_open(str(file), framework="pt") as f:
                assert f.metadata()["diffpipe.expert"] == folder
    files = {f"diffusion_model{s}": tmp_path / "single_file" / e / wan.single_file_name
             for s, e in (("", "high_noise"), ("_2", "low_noise"))}
    back = wan.load_diffusion_model(cfg.model_copy(update=files), CPU, torch.float32).state_dict()
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_a_one_expert_run_labels_its_files_too(tiny_wan_a14b: Path, tmp_path: Path) -> None:
    """``expert = "low"``: one adapter in ``saved/<name>/`` (no sub-folders), its files labelled low-noise; the core
    writes the labels into every file's metadata and ``adapter_config.json`` and the summary line names them."""
    from diffpipe_core.adapters import adapter_state_dict
    from diffpipe_core.engine.saving import saved_parts, write_adapter
    from diffpipe_core.registry import get_registry

    cfg = _config(tiny_wan_a14b).model_copy(update={"expert": "low"})
    targets = wan.lora_targets(model_config=cfg)
    model = runs.with_random_lora(WanTransformer3DModel.from_pretrained(str(tiny_wan_a14b / "transformer_2")), targets)
    state = adapter_state_dict(model)
    ((part, (same, labels)),) = wan.adapter_parts(state_dict=state, model_config=cfg).items()
    assert part == "" and same is state and labels["diffpipe.expert"] == "low_noise"
    assert wan.adapter_parts(state_dict=state, model_config=_config(tiny_wan_a14b))["low_noise"][0] == {}
    saved = tmp_path / "saved" / "final"
    plugin = get_registry().model("wan")
    assert write_adapter(saved, state, plugin, lora_config(4, 6.0, 0.0, targets), ["comfyui"], torch.float32, cfg) == []
    assert sorted(p.name for p in saved.iterdir()) == [
        "adapter_config.json", "adapter_model.comfyui.safetensors", "adapter_model.safetensors"]
    for name in ("adapter_model.safetensors", "adapter_model.comfyui.safetensors"):
        with safe_open(str(saved / name), framework="pt") as f:
            assert f.metadata()["diffpipe.component"] == "transformer_2", name
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["diffpipe.expert"] == "low_noise" and config["r"] == 4
    assert saved_parts(saved) == [f"final: {labels['diffpipe.part']}"]
    assert labels["diffpipe.part"] == (
        "Wan 2.2 A14B low-noise expert (transformer_2, t < 0.875; WanPipeline.load_lora_weights(..., "
        "load_into_transformer_2=True))"
    )
