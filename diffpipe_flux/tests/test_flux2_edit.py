"""FLUX.2 reference images (edit training) on ``flux2-klein`` (the same code serves ``flux2``): a reference image's
cached latents and position ids equal what ``Flux2KleinPipeline.prepare_image_latents`` builds, the loss covers the
target's tokens only; one shared 1-process run on edit pairs with two reference images each (``control_path``
folders, one of another aspect ratio) trains every default LoRA target, its diffusers LoRA reproduces the trained
transformer on target + reference tokens, and its first sample, drawn with two reference images, is the pipeline's
``image=`` output for the same noise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset, write_png
from diffpipe_core.types import control_key
from diffpipe_flux.config import Flux2KleinConfig
from diffpipe_flux.flux2 import klein
from diffpipe_flux.flux2_latents import image_ids, text_ids

RANK, ALPHA, STEPS, SEED, LENGTH = 4, 8.0, 16, 5, 24
PROMPT = "make it red"
INSTRUCTIONS = ["make it red", "add a dog", "turn it to night", "remove the tree"]
#: the sample's reference images, at the sample's size: our decode (the sample's pixel count) and the pipeline's
#: preprocessing (its own size, sides of at least 64) keep them as they are
SAMPLE_REFERENCES = {"ref_a.png": (64, 64), "ref_b.png": (64, 64)}
SAMPLE_SIZE = 64


def config(path: Path) -> Flux2KleinConfig:
    table = {"type": "flux2-klein", "path": path, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": LENGTH}  # fmt: skip
    return validate(Flux2KleinConfig, table, "test")


def test_reference_latents_and_ids_equal_the_pipelines(tiny_klein: Path) -> None:
    from diffusers import Flux2KleinPipeline

    cfg = config(tiny_klein)
    g = torch.Generator().manual_seed(0)
    # two items, each with two reference images of their own sizes (48x32 and 32x16 pixels)
    refs = [torch.rand(2, 3, 32, 48, generator=g) * 2 - 1, torch.rand(2, 3, 16, 32, generator=g) * 2 - 1]
    encoders = klein.load_encoders(model_config=cfg, device=torch.device("cpu"))
    batch = {"latents": torch.randn(2, 16, 2, 2, generator=g), "text_embeds": torch.randn(2, 8, 48, generator=g)}
    for k, pixels in enumerate(refs):
        media = EncodeBatch(pixels=pixels, control_index=k, original_sizes=[(32, 48)] * 2, crop_coords=[(0, 0)] * 2)
        (key,) = encoded = klein.encode_batch(encoders=encoders, batch=media)
        assert key == "latents"
        batch[control_key(k, "latents")] = encoded["latents"]
    (x, t, text, guidance, ids, txt_ids), (velocity,) = klein.prepare_inputs(
        batch=batch, context=TrainingContext(cfg), generator=torch.Generator().manual_seed(1)
    )

    pipe = Flux2KleinPipeline.from_pretrained(str(tiny_klein), local_files_only=True)
    n = 4  # the target's 2x2 tokens come first
    assert x.shape == (2, n + 2 * 3 + 1 * 2, 16) and velocity.shape == (2, n, 16)
    for i in range(2):
        with torch.no_grad():
            expected, expected_ids = pipe.prepare_image_latents(
                [r[i : i + 1] for r in refs], 1, None, torch.device("cpu"), torch.float32
            )
        torch.testing.assert_close(x[i, n:], expected[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(ids[n:], expected_ids[0])  # time 10 for the first reference, 20 for the second
    assert torch.equal(ids[:n], image_ids(2, 2)) and torch.equal(txt_ids, text_ids(8))
    # the loss covers the target's tokens: a prediction wrong only on the references' tokens costs nothing
    prediction = torch.cat([velocity, torch.full((2, x.shape[1] - n, 16), 100.0)], dim=1)
    assert klein.compute_loss(outputs=(prediction,), targets=(velocity,), context=TrainingContext(cfg)) == 0
    assert klein.compute_loss(outputs=(prediction + 1,), targets=(velocity,), context=TrainingContext(cfg)) > 0


def make_project(root: Path, model: Path) -> Path:
    write_image_dataset(root / "edit", 4, size=(32, 32), captions=INSTRUCTIONS)
    for folder, size, seed in (("before", (32, 32), 1), ("style", (64, 32), 2)):  # the second: its own aspect ratio
        for png in write_image_dataset(root / folder, 4, size=size, seed=seed):
            png.with_suffix(".txt").unlink()  # a control folder holds images only
    control = [str(root / "before"), str(root / "style")]
    write_dataset_toml(root / "dataset.toml", root / "edit", directory_keys={"control_path": control},
                       resolutions=[32], enable_ar_bucket=True, ar_buckets=[1.0, 2.0])  # fmt: skip
    for name, size in SAMPLE_REFERENCES.items():
        write_png(root / name, *size, seed=len(name) + size[0])
    model_table = {"type": "flux2-klein", "path": str(model), "dtype": "float32", "encoder_dtype": "float32",
                   "text_max_length": LENGTH, "timestep_sample_method": "uniform"}  # fmt: skip
    sample = {"prompts": [PROMPT], "control_images": [[str(root / n) for n in SAMPLE_REFERENCES]],
              "before_first_step": True, "every_n_steps": STEPS, "steps": 2, "seed": SEED,
              "resolution": SAMPLE_SIZE}  # fmt: skip
    toml = runs.run_toml(
        model_table, {"lr": 3e-2}, {"rank": RANK, "alpha": ALPHA}, sample,
        max_steps=STEPS, micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, checkpoint_every_n_steps=STEPS,
        seed=7,
    )  # fmt: skip
    (root / "run.toml").write_text(toml)
    return root / "run.toml"


@pytest.fixture(scope="module")
def edit_run(tmp_path_factory: pytest.TempPathFactory, tiny_klein: Path) -> Path:
    """4 edit pairs (a 32x32 target, a 32x32 and a 64x32 reference: buckets 32x32 and 32x16), 1 process, sampling
    with two references."""
    root = tmp_path_factory.mktemp("flux2_edit")
    return runs.train(root, make_project(root, tiny_klein), procs=1, timeout=400)


@pytest.mark.slow
def test_edit_pairs_train_every_target(edit_run: Path) -> None:
    from diffpipe_core.data.cache_store import list_shards

    runs.assert_loss_falls(edit_run, STEPS, 4)
    ups = {k: v for k, v in runs.checkpoint_params(edit_run).items() if ".lora_B." in k}
    assert len(ups) == 2 * 12 + 2 * 2  # 12 linears per double block, 2 per single block (2 + 2 blocks)
    assert all(v.abs().max() > 0 for v in ups.values()), [k for k, v in ups.items() if not v.abs().max() > 0]
    tables = list((edit_run.parent.parent / "cache").rglob("controls"))
    shards = [shard for table in tables for shard in list_shards(table)]
    assert sum(len(shard.keys) for shard in shards) == 2 * len(INSTRUCTIONS)  # both references of every pair
    shapes = {tuple(v.shape[1:]) for shard in shards for v in shard.gather(list(range(len(shard.keys)))).values()}
    assert shapes == {(16, 2, 2), (16, 1, 2)}, shapes  # the second reference in its own 32x16 bucket


@pytest.mark.slow
def test_edit_lora_reproduces_on_reference_tokens(edit_run: Path, tiny_klein: Path) -> None:
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    from diffpipe_core.adapters import read_adapter

    model, saved = tiny_klein, edit_run / "saved" / "final"
    _, cfg = read_adapter(saved)
    fresh = Flux2Transformer2DModel.from_pretrained(str(model / "transformer"))
    reference = runs.with_trained_lora(fresh, edit_run, RANK, ALPHA, cfg["target_modules"])
    pipe = Flux2KleinPipeline.from_pretrained(str(model), local_files_only=True)
    grids = [torch.zeros(1, 16, 2, 2), torch.zeros(1, 16, 2, 4)]
    ref_ids = pipe._prepare_image_ids(grids)[0]
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 4 + 4 + 8, 16, generator=g),  # target, then both references' tokens
        "encoder_hidden_states": torch.randn(2, 8, 48, generator=g),
        "timestep": torch.rand(2, generator=g),
        "img_ids": torch.cat([image_ids(2, 2), ref_ids])[None],
        "txt_ids": text_ids(8)[None],
    }
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, inputs)


@pytest.mark.slow
def test_first_sample_with_references_is_the_pipelines(edit_run: Path, tiny_klein: Path) -> None:
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline
    from PIL import Image
    from safetensors.torch import load_file

    from diffpipe_core.registry import get_registry
    from diffpipe_core.sampling.loop import noise_generator
    from diffpipe_core.sampling.prompts import encode_prompts

    root, model = edit_run.parent.parent, tiny_klein
    first = load_file(str(edit_run / "samples" / "step-0000000" / "latents.safetensors"))["sample_00"]
    last = load_file(str(edit_run / "samples" / f"step-{STEPS:07d}" / "latents.safetensors"))["sample_00"]
    (texts,) = encode_prompts(get_registry().model("flux2-klein"), config(model), [PROMPT], None, torch.device("cpu"))
    pipe = Flux2KleinPipeline.from_pretrained(str(model), dtype=torch.float32, local_files_only=True)
    n = SAMPLE_SIZE // 16
    noise = torch.randn((1, 16, n, n), generator=noise_generator(SEED, 0))
    images = [Image.open(root / name).convert("RGB") for name in SAMPLE_REFERENCES]
    expected = pipe(
        image=images, prompt_embeds=texts.cond["text_embeds"], latents=noise.clone(), num_inference_steps=2,
        height=SAMPLE_SIZE, width=SAMPLE_SIZE, output_type="latent", guidance_scale=1.0,
    ).images  # fmt: skip
    vae = AutoencoderKLFlux2.from_pretrained(str(model / "vae"), local_files_only=True)
    torch.testing.assert_close(klein.denormalize(first, vae), expected, rtol=1e-4, atol=1e-5)
    without = pipe(
        prompt_embeds=texts.cond["text_embeds"], latents=noise.clone(), num_inference_steps=2, height=SAMPLE_SIZE,
        width=SAMPLE_SIZE, output_type="latent", guidance_scale=1.0,
    ).images  # fmt: skip
    assert (without - expected).abs().max() > 1e-3  # the reference images changed the sample
    assert (first - last).abs().max() > 1e-3  # the LoRA trained between them
