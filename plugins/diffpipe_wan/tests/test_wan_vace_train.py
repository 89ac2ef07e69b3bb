"""Wan VACE end to end through the real CLI (DeepSpeed on gloo, the real cache, peft), on one shared run: mp4 clips
paired by file name with the control videos of ``control_path``, 1 stage in 1 process; the loss falls, the LoRA
covers the VACE blocks too and, loaded with ``WanVACEPipeline.load_lora_weights``, reproduces the trained
transformer; a clip without its control video is an error naming both files before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_png, write_video
from diffpipe_wan.testing import write_clips, write_tiny_wan_vace

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 40
MODEL = {"type": "wan-vace", "text_max_length": 8, "timestep_sample_method": "uniform", "min_t": 0.8}
CAPTIONS = ["a red car moving", "a river in a city", "a dog running", "a bright sky"]


def make_project(root: Path, model: dict | None = None, writer=write_tiny_wan_vace, steps: int = STEPS,
                 vace_files: bool = False) -> Path:
    """The tiny Wan VACE (or ``writer``'s model, ``model`` its table), 4 mp4 clips of 5 frames at 16 fps, 32x32,
    each with a control video of the same stem (longer and larger: decoded at the clip's frames and bucket);
    ``vace_files``: each also with a mask video (``control_mask_path``) and a 24x40 reference image
    (``reference_path``)."""
    writer(root / "model")
    clips = write_clips(root / "media", CAPTIONS, frames=5, size=(32, 32))
    keys = {"control_path": str(root / "control")}
    for i, clip in enumerate(clips):
        write_video(root / "control" / clip.name, 7, fps=16, size=(40, 40), seed=100 + i)
        if vace_files:
            write_video(root / "masks" / clip.name, 7, fps=16, size=(40, 40), seed=200 + i)
            (root / "refs").mkdir(exist_ok=True)
            write_png(root / "refs" / f"{clip.stem}.png", 24, 40, seed=300 + i)
    if vace_files:
        keys.update(control_mask_path=str(root / "masks"), reference_path=str(root / "refs"))
    write_dataset_toml(root / "dataset.toml", root / "media", keys, resolutions=[32], enable_ar_bucket=False,
                       frame_buckets=[5])
    top = {"max_steps": steps, "pipeline_stages": 1, "checkpoint_every_n_steps": steps, "seed": 3}
    (root / "run.toml").write_text(runs.lora_run_toml(model or MODEL, 1e-2, None, RANK, ALPHA, **top))
    return root / "run.toml"


@pytest.fixture(scope="module")
def vace_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wan-vace-run")
    return runs.train(root, make_project(root, vace_files=True), procs=1, timeout=600, OMP_NUM_THREADS="1")


def test_loss_falls_on_clips_with_control_videos_masks_and_references(vace_run: Path) -> None:
    """Each clip's cached context holds its reference image's latent frame before the clip's two, and its mask
    video's channels (not the all-ones mask of a clip without one)."""
    from diffpipe_core.data.cache_store import list_shards

    runs.assert_loss_falls(vace_run, STEPS, 8)
    cache = vace_run.parent.parent / "cache"
    shards = [s for folder in cache.rglob("controls") for s in list_shards(folder)]
    assert shards and all(s.columns["context"][0] == (72, 3, 4, 4) for s in shards), [s.columns for s in shards]
    contexts = torch.cat([torch.from_numpy(s.arrays()["context"].astype("float32")) for s in shards])
    assert contexts.shape[0] == 4 and contexts[:, 8:, 0].abs().max() == 0  # the reference frame: a zero mask
    assert 0 < contexts[:, 8:, 1:].mean() < 1, contexts[:, 8:, 1:].mean()  # the mask videos, not all ones


def transformer_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {
        "hidden_states": torch.randn(2, 4, 2, 4, 4, generator=g),
        "timestep": torch.rand(2, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "control_hidden_states": torch.randn(2, 72, 2, 4, 4, generator=g),
    }


def test_lora_loads_in_wan_vace_pipeline_and_reproduces(vace_run: Path) -> None:
    from diffusers import WanVACEPipeline, WanVACETransformer3DModel

    saved = vace_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    assert {"transformer.vace_blocks.0.proj_in.lora_A.weight", "transformer.vace_blocks.1.attn1.to_q.lora_B.weight",
            "transformer.blocks.2.ffn.net.2.lora_A.weight"} <= set(state)
    model = vace_run.parent.parent / "model"
    fresh = WanVACETransformer3DModel.from_pretrained(str(model / "transformer"))
    reference = runs.with_trained_lora(fresh, vace_run, RANK, ALPHA, cfg["target_modules"])
    pipe = WanVACEPipeline.from_pretrained(str(model), local_files_only=True)
    untrained = runs.outputs(pipe.transformer, transformer_inputs())
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    got = runs.outputs(pipe.transformer, transformer_inputs())
    expected = runs.outputs(reference, transformer_inputs())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    runs.assert_reproduces(got, expected, untrained)


def test_a_clip_without_its_control_video_is_an_error_naming_it(tmp_path: Path) -> None:
    from diffpipe_core.data.dataset_config import load_dataset_config
    from diffpipe_core.data.scan import DatasetError, scan_dataset

    clips = write_clips(tmp_path / "media", CAPTIONS[:3], frames=5, size=(32, 32))
    write_video(tmp_path / "control" / clips[0].name, 7, fps=16, size=(32, 32))
    write_video(tmp_path / "control" / clips[1].name, 2, fps=16, size=(32, 32))  # too short for a 5-frame clip
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "media", {"control_path": "control"},
                              resolutions=[32], enable_ar_bucket=False, frame_buckets=[5])
    with pytest.raises(DatasetError) as err:
        scan_dataset(load_dataset_config(toml), wan_vace_spec(), progress=False, report_skipped=False)
    text = str(err.value)
    assert f"{clips[2]}: no control video: {tmp_path / 'control' / clips[2].stem}.<video extension> not found" in text
    assert f"{clips[1]}: control video too short: {tmp_path / 'control' / clips[1].name}" in text
    assert str(clips[0]) not in text


def wan_vace_spec():
    from diffpipe_wan.vace import wan_vace

    return wan_vace.spec


def test_an_image_in_the_dataset_is_an_error_naming_it(tmp_path: Path) -> None:
    from diffpipe_core.data.dataset_config import load_dataset_config
    from diffpipe_core.data.scan import DatasetError, scan_dataset
    from diffpipe_core.testing.media import write_png

    write_clips(tmp_path / "media", CAPTIONS[:1], frames=5, size=(32, 32))
    image = write_png(tmp_path / "media" / "still.png", 32, 32)
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "media", {"control_path": "control"},
                              resolutions=[32], enable_ar_bucket=False, frame_buckets=[1, 5])
    (tmp_path / "control").mkdir()
    with pytest.raises(DatasetError, match=f"trains video-to-video only .*: {image}"):
        scan_dataset(load_dataset_config(toml), wan_vace_spec(), progress=False, report_skipped=False)


def test_comfyui_lora_names_the_original_vace_modules(vace_run: Path) -> None:
    """The ComfyUI file's modules are ``diffusion_model.<original module>`` of the VACE layout (``before_proj``,
    ``after_proj``, ``vace_blocks.N.self_attn.q``, ...), every one a key ComfyUI's key map makes for the model."""
    from safetensors.torch import load_file

    from diffpipe_core.testing import comfy
    from diffpipe_wan.testing import single_file_path

    file = load_file(str(vace_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in file}
    original = load_file(str(single_file_path(vace_run.parent.parent / "model")))
    assert {"diffusion_model.vace_blocks.0.before_proj", "diffusion_model.vace_blocks.1.after_proj",
            "diffusion_model.vace_blocks.1.self_attn.q", "diffusion_model.blocks.2.ffn.2"} <= modules
    assert modules <= set(comfy.generic_key_map(original))
