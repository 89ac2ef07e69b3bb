"""Host memory per worker with 1, 2 and 4 pipeline stages, for any installed model: how evenly the stages split.

    python bench/stage_memory.py --model hunyuan-video [--rounds 3] [--layouts 1,2,4] [--regimes users,single]
    python bench/stage_memory.py --model flux --smoke        # one round, the tiny model: checks the bench runs

For the model type named by ``--model``, a random-weight model of the size in :data:`SIZES` is written to disk in
its real format (float32 files, trained in bfloat16, so every loaded weight is anonymous memory), with eight 64x64
captioned images (or the type's own dataset: edit pairs, 5-frame clips); the dataset is cached once (``diffpipe
cache``). Then ``diffpipe train`` trains a LoRA (rank 4, micro-batch 1) with 1, 2 and 4 stages on as many
processes in each regime of :data:`REGIMES`: ``users`` as users run a pipeline (gradient accumulation 2 x stages,
so DeepSpeed's 1F1B schedule keeps up to that many micro-batches in flight on the first stage; 3 steps; a
checkpoint and an adapter save after step 2, and the final ones after step 3) and ``single`` (one step of one
micro-batch, the bench's regime before issue 46). The layouts are taken in turn and in reverse order in every other
round (alternating, as the other benches), while every worker's anonymous RSS (``RssAnon`` in /proc, so
memory-mapped files don't count) is sampled every 20 ms and its peak kept. An idle worker's baseline (the same
layout and regime on the tiny model of the same type) is subtracted to give the model's memory; per round, the
largest stage's model memory over the 1-stage run's is its share. Reported per regime: each worker's peak, the
share's median and spread per layout, each stage's estimate over its measured model memory (median and spread),
and, from the last round, where each stage's memory goes (the workers' ``DIFFPIPE_MEMORY_REPORT``: anonymous RSS
after caching, after building the stage, after every step, save and checkpoint, and every live tensor by what holds
it after the first step; the worker's own 5 ms sampler gives the phase its peak fell in and the C heap's live and free
bytes at that moment) beside the stage plan's estimate. Targets for HunyuanVideo, Flux and Wan at >= 0.6 B
parameters and >= 24 blocks, in the users' regime: share <= 0.55 for 2 stages and <= 0.30 for 4; every stage's
estimated peak within 15% of its measured model memory.

Adding a model is one :data:`SIZES` entry: a function writing the model
at the bench size (or the tiny one) and returning its ``[model]`` keys, and a dataset writer where it needs one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from diffpipe_core.engine.memory_report import ENV as REPORT_ENV
from diffpipe_core.engine.memory_report import rss_anon
from diffpipe_core.testing import warm_cli
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import cli_env, kill_group, run_diffpipe

MiB = 2**20


# ------------------------------------------------------------------------------------------------ the size table
def _reference(folder: Path, big: bool) -> dict:
    from diffpipe_reference.model import TinyDiTConfig, write_tiny_model

    write_tiny_model(folder, TinyDiTConfig(dim=1024, depth=12, heads=16) if big else TinyDiTConfig())
    return {}


#: the tiny model's blocks where its testing default has 2 (one stream): 4 stages need a trainable block each
TINY = dict(num_layers=4)
FLUX_SIZE = dict(num_layers=10, num_single_layers=20, num_attention_heads=8, attention_head_dim=128)


def _flux(folder: Path, big: bool) -> dict:
    from diffpipe_flux.testing import TinyFluxConfig, tiny_pipeline

    size = dict(FLUX_SIZE, axes_dims_rope=(16, 56, 56))
    tiny_pipeline(TinyFluxConfig(**size) if big else TinyFluxConfig()).save_pretrained(folder, safe_serialization=True)
    return {"t5_max_length": 16}


def _flux_files(form: str | None) -> Callable[[Path, bool], dict]:
    """Flux from ComfyUI component files (issue 35): the BFL transformer under ``model.diffusion_model.`` (quantized
    as ``form``, e.g. ``"fp8_scaled"``), the LDM VAE and the text encoders, beside a folder of configs only."""

    def write(folder: Path, big: bool) -> dict:
        import shutil

        from diffpipe_core.parts.ldm import vae_table
        from diffpipe_core.testing.component_files import config_only, quantize_file, write_component_files
        from diffpipe_flux.bfl import layout_for_config

        _flux(folder, big)
        config = json.loads((folder / "transformer" / "config.json").read_text())
        vae = json.loads((folder / "vae" / "config.json").read_text())
        files = write_component_files(folder, folder.parent / "comfy", layout_for_config(config), vae_table(vae, ""))
        configs = config_only(folder, folder.parent / "configs")
        shutil.rmtree(folder)
        configs.rename(folder)  # the folder the run names: configs and tokenizers only
        dit = files["diffusion_model"]
        if form is not None:
            dit = quantize_file(dit, dit.with_name(f"dit-{form}.safetensors"), form)
        texts = [str(p) for p in files["text_encoders"]]
        return {"t5_max_length": 16, "diffusion_model": str(dit), "vae": str(files["vae"]), "text_encoders": texts}

    return write


def _chroma(folder: Path, big: bool) -> dict:
    from diffpipe_flux.testing import TinyChromaConfig, bfl_path, write_tiny_chroma

    write_tiny_chroma(folder, TinyChromaConfig(**FLUX_SIZE, axes_dims_rope=(16, 56, 56)) if big else None)
    bfl_path(folder).unlink()  # the original-layout copy: not used here
    return {"t5_max_length": 16}


def _flux2(pipeline: str) -> Callable[[Path, bool], dict]:
    """FLUX.2 [dev] (``Flux2Pipeline``) or [klein] (``Flux2KleinPipeline``)."""

    def write(folder: Path, big: bool) -> dict:
        from diffpipe_flux.testing import TinyFlux2Config, bfl_path, dev_config, write_tiny_flux2

        klein = pipeline == "Flux2KleinPipeline"
        size = dict(FLUX_SIZE, axes_dims_rope=(32, 32, 32, 32)) if big else {}
        write_tiny_flux2(folder, TinyFlux2Config(**size) if klein else dev_config(**size), pipeline)
        bfl_path(folder).unlink()  # the original-layout copy: not used here
        return {"text_max_length": 24 if klein else 48}  # the chat template and the caption fit

    return write


def _hunyuan(folder: Path, big: bool) -> dict:
    from diffpipe_hunyuan.testing import TinyHunyuanConfig, llama_tokenizer, template_crop_start, tiny_pipeline

    size = dict(num_layers=10, num_single_layers=20, num_attention_heads=8, attention_head_dim=128,
                rope_axes_dim=(16, 56, 56))  # fmt: skip
    cfg = TinyHunyuanConfig(**size) if big else TinyHunyuanConfig()
    tiny_pipeline(cfg).save_pretrained(folder, safe_serialization=True)
    return {"text_max_length": 8, "text_crop_start": template_crop_start(llama_tokenizer())}


def _ltx(folder: Path, big: bool) -> dict:
    from diffpipe_ltx.testing import TinyLTXConfig, tiny_pipeline

    cfg = TinyLTXConfig(num_layers=16, num_attention_heads=16, attention_head_dim=64) if big else TinyLTXConfig(**TINY)
    tiny_pipeline(cfg).save_pretrained(folder, safe_serialization=True)
    return {"t5_max_length": 16}


def _hunyuan15(i2v: bool) -> Callable[[Path, bool], dict]:
    """HunyuanVideo-1.5, text-to-video or image-to-video (``i2v``: with SigLIP)."""

    def write(folder: Path, big: bool) -> dict:
        from diffpipe_hunyuan import testing15 as h15

        size = dict(num_layers=16, num_attention_heads=8, attention_head_dim=128, rope_axes_dim=(16, 56, 56))
        h15.write_tiny_hunyuan15(folder, h15.TinyHunyuan15Config(**(size if big else TINY)), i2v=i2v)
        h15.original_path(folder).unlink()  # the original-layout copy: not used here
        crop = h15.template_crop_start(h15.qwen_tokenizer())
        return {"text_max_length": 8, "glyph_max_length": 8, "text_crop_start": crop}

    return write


def _ltx2(folder: Path, big: bool) -> dict:
    from diffpipe_ltx.ltx2_testing import TinyLTX2Config, single_file_path, write_tiny_ltx2

    size = dict(num_layers=24, num_attention_heads=16, attention_head_dim=64) if big else TINY
    write_tiny_ltx2(folder, TinyLTX2Config(**size))
    single_file_path(folder).unlink()  # the original-layout copy: not used here
    return {"max_sequence_length": 16}  # a multiple of the connectors' registers


def _cosmos(variant: str) -> Callable[[Path, bool], dict]:
    def write(folder: Path, big: bool) -> dict:
        from diffpipe_cosmos.testing import TinyCosmosConfig, original_path, write_tiny_cosmos
        from diffpipe_cosmos.testing_predict25 import TinyPredict25Config, write_tiny_predict25

        if variant == "predict2.5":  # a diffusers folder only, Qwen2.5-VL text
            size = dict(num_layers=16, num_attention_heads=24, attention_head_dim=64, mlp_ratio=4.0) if big else TINY
            write_tiny_predict25(folder, TinyPredict25Config(**size))
            return {"text_max_length": 32}  # the chat template takes 22
        size = dict(num_layers=16, num_attention_heads=16, attention_head_dim=64, mlp_ratio=4.0) if big else TINY
        write_tiny_cosmos(folder, TinyCosmosConfig(variant=variant, **size))
        original_path(folder).unlink()  # the original-layout copy: not used here
        # Cosmos-1.0's VAE pools in 3-D, which torch has no bfloat16 CPU kernel for: it encodes in float32
        return {"t5_max_length": 16, **({"encoder_dtype": "float32"} if variant == "1.0" else {})}

    return write


def _wan(i2v: bool) -> Callable[[Path, bool], dict]:
    """Wan 2.1 text-to-video, or image-to-video (``i2v``: with CLIP vision, attending to exactly 512 text tokens)."""

    def write(folder: Path, big: bool) -> dict:
        from diffpipe_wan.testing import TinyWanConfig, single_file_path, write_tiny_wan

        size = dict(num_layers=24, num_attention_heads=8, attention_head_dim=128, ffn_dim=8960, text_dim=64)
        write_tiny_wan(folder, TinyWanConfig(i2v=i2v, clip=i2v, **(size if big else TINY)))
        single_file_path(folder).unlink()  # the original-layout copy: not used here
        return {"text_max_length": 512 if i2v else 16}

    return write


def _qwen(pipeline: str) -> Callable[[Path, bool], dict]:
    """Qwen-Image (``QwenImagePipeline``) or Qwen-Image-Edit (``QwenImageEditPipeline``)."""

    def write(folder: Path, big: bool) -> dict:
        from diffpipe_qwenimage.testing import TinyQwenConfig, comfy_path, write_tiny_qwen

        size = dict(num_layers=16, num_attention_heads=8, attention_head_dim=128, axes_dims_rope=(16, 56, 56))
        write_tiny_qwen(folder, pipeline, TinyQwenConfig(**(size if big else TINY)))
        comfy_path(folder).unlink()  # the ComfyUI-layout copy: not used here
        if pipeline == "QwenImagePipeline":
            return {"text_max_length": 16}
        return {"text_max_length": 32, "vl_image_area": 1024}  # the edit template and the control image's tokens

    return write


def _zimage(folder: Path, big: bool) -> dict:
    from diffpipe_zimage.testing import TinyZImageConfig, original_path, write_tiny_zimage

    size = dict(dim=1536, n_layers=16, n_heads=12, axes_dims=(32, 48, 48)) if big else {"n_layers": TINY["num_layers"]}
    write_tiny_zimage(folder, TinyZImageConfig(**size))
    original_path(folder).unlink()  # the original-layout copy: not used here
    return {"text_max_length": 24}


def _sdxl(folder: Path, big: bool) -> dict:
    from diffusers import UNet2DConditionModel

    from diffpipe_sdxl.testing import TINY_UNET, write_tiny_sdxl

    write_tiny_sdxl(folder)
    if big:  # three levels at 256/512/1024 channels; text encoders stay tiny (cross-attention width 64)
        unet = UNet2DConditionModel(**{
            **TINY_UNET, "block_out_channels": (256, 512, 1024), "attention_head_dim": (4, 8, 16),
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            "transformer_layers_per_block": (1, 1, 1), "norm_num_groups": 32,
        })  # fmt: skip
        unet.save_pretrained(folder / "unet", safe_serialization=True)
    return {}


#: one micro-batch each; 8 fill the largest gradient accumulation the bench runs (2 x 4 stages)
CAPTIONS = [f"a {colour} {animal}" for colour in ("red", "blue") for animal in ("cat", "dog", "fox", "owl")]


def _edit_pairs(root: Path) -> Path:
    """64x64 captioned targets, each with a control image of the same stem (``control_path``)."""
    write_image_dataset(root / "images", len(CAPTIONS), size=(64, 64), captions=CAPTIONS)
    for png in write_image_dataset(root / "control", len(CAPTIONS), size=(64, 64), seed=1):
        png.with_suffix(".txt").unlink()  # a control folder holds images only
    return write_dataset_toml(root / "dataset.toml", root / "images", directory_keys={"control_path": root / "control"},
                              resolutions=[64])  # fmt: skip


def _clips(write: Callable[[Path], object]) -> Callable[[Path], Path]:
    """Captioned 5-frame 64x64 clips, as the plugin's ``write(folder)`` writes them (i2v: first frames too)."""

    def dataset(root: Path) -> Path:
        write(root / "clips")
        return write_dataset_toml(root / "dataset.toml", root / "clips", resolutions=[64], enable_ar_bucket=False,
                                  frame_buckets=[5])  # fmt: skip

    return dataset


def _wan_clips(folder: Path) -> None:
    from diffpipe_wan.testing import write_clips

    write_clips(folder, CAPTIONS, frames=5, size=(64, 64))


def _hunyuan_clips(folder: Path) -> None:
    from diffpipe_hunyuan.testing import write_clip_dataset

    write_clip_dataset(folder, [5] * len(CAPTIONS), CAPTIONS, size=(64, 64), fps=24)


@dataclass(frozen=True)
class Size:
    """How the bench writes one model type: ``write(folder, big)`` writes the bench-size model (``big``) or the
    tiny one (the idle baseline) and returns its ``[model]`` keys besides type, path and dtype; ``note`` says what
    the bench size is; ``dataset(root)``, where the type needs more than captioned images (control images, clips),
    writes its dataset under ``root`` and returns its dataset.toml."""

    write: Callable[[Path, bool], dict]
    note: str
    dataset: Callable[[Path], Path] | None = None
    model_type: str | None = None  # the [model] type, where the entry's name is not one (flux-files: flux)


SIZES: dict[str, Size] = {
    "reference": Size(_reference, "TinyDiT width 1024, 12 blocks"),
    "flux": Size(_flux, "Flux width 1024 (8 x 128), 10 double + 20 single blocks (half Flux.1's counts)"),
    "flux-kontext": Size(_flux, "Flux Kontext width 1024 (8 x 128), 10 double + 20 single blocks (0.70 B), edit pairs",
                         _edit_pairs),
    "flux-files": Size(_flux_files(None), "Flux as flux (0.70 B), from ComfyUI files: BFL transformer, LDM VAE, "
                       "text encoders; the folder holds configs only", model_type="flux"),
    "flux-fp8": Size(_flux_files("fp8_scaled"), "Flux as flux-files, the transformer file fp8 scaled (ComfyUI's)",
                     model_type="flux"),
    "chroma": Size(_chroma, "Chroma width 1024 (8 x 128), 10 double + 20 single blocks (0.50 B)"),
    "flux2": Size(_flux2("Flux2Pipeline"), "FLUX.2 [dev] width 1024 (8 x 128), 10 double + 20 single blocks (0.57 B)"),
    "flux2-klein": Size(_flux2("Flux2KleinPipeline"),
                        "FLUX.2 [klein] width 1024 (8 x 128), 10 double + 20 single blocks (0.56 B)"),
    "sdxl": Size(_sdxl, "SDXL-like UNet 256/512/1024 channels, 1 transformer per attention block"),
    "hunyuan-video": Size(_hunyuan, "HunyuanVideo width 1024 (8 x 128), 10 double + 20 single blocks (half the real)"),
    "hunyuan-video-1.5": Size(_hunyuan15(False), "HunyuanVideo-1.5 width 1024 (8 x 128), 16 blocks (0.63 B)"),
    "hunyuan-video-1.5-i2v": Size(_hunyuan15(True), "HunyuanVideo-1.5 I2V width 1024 (8 x 128), 16 blocks (0.63 B), "
                                  "5-frame clips", _clips(_hunyuan_clips)),
    "ltx-video": Size(_ltx, "LTX-Video width 1024 (16 x 64), 16 blocks"),
    "ltx-2": Size(_ltx2, "LTX-2 video width 1024 (16 x 64), audio 512, 24 blocks (0.60 B)"),
    "cosmos": Size(_cosmos("1.0"), "Cosmos-1.0 width 1024 (16 x 64), 16 blocks"),
    "cosmos-predict2": Size(_cosmos("predict2"), "Cosmos-Predict2 width 1024 (16 x 64), 16 blocks"),
    "cosmos-predict2.5": Size(_cosmos("predict2.5"), "Cosmos-Predict2.5 width 1536 (24 x 64), 16 blocks (0.54 B)"),
    "wan": Size(_wan(False), "Wan 2.1 width 1024 (8 x 128), FFN 8960, 24 blocks (0.65 B)"),
    "wan-i2v": Size(_wan(True), "Wan 2.1 I2V width 1024 (8 x 128), FFN 8960, 24 blocks, 5-frame clips",
                    _clips(_wan_clips)),
    "qwen-image": Size(_qwen("QwenImagePipeline"), "Qwen-Image width 1024 (8 x 128), 16 blocks (0.61 B)"),
    "qwen-image-edit": Size(_qwen("QwenImageEditPipeline"),
                            "Qwen-Image-Edit width 1024 (8 x 128), 16 blocks (0.61 B), edit pairs", _edit_pairs),
    "z-image": Size(_zimage, "Z-Image width 1536 (12 x 128), 16 + 2 + 2 refiner blocks (0.60 B)"),
}

@dataclass(frozen=True)
class Regime:
    """How each run trains: gradient accumulation ``gas_per_stage`` x stages (at least 1), ``steps`` optimizer
    steps, and, with ``every``, a checkpoint and an adapter save after every ``every`` steps inside the run (the
    final save and checkpoint come after the last step in every regime)."""

    gas_per_stage: int
    steps: int
    every: int | None
    note: str

    def gas(self, stages: int) -> int:
        return max(1, self.gas_per_stage * stages)


REGIMES: dict[str, Regime] = {
    "users": Regime(2, 3, 2, "as users run it: gradient accumulation 2 x stages, 3 steps, a checkpoint and a save "
                    "after step 2, the final save and checkpoint after step 3"),
    "single": Regime(0, 1, None, "one step of one micro-batch, then the final save and checkpoint (the bench's "
                     "regime before issue 46)"),
}

RUN = """
output_dir = "out"
dataset = "{dataset}"
max_steps = {steps}
micro_batch_size_per_gpu = 1
gradient_accumulation_steps = {gas}
pipeline_stages = {stages}
{every}
{extra}
[model]
type = "{model}"
path = "{path}"
dtype = "{dtype}"
{keys}
[adapter]
rank = 4
"""


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else repr(value)


@dataclass
class Project:
    root: Path
    model: str
    path: Path
    keys: dict
    dataset: Path
    extra: str = ""  # more top-level keys (a GPU-fit fragment's savers: tests/test_gpu_fit.py)
    dtype: str = "bfloat16"  # [model] dtype

    def config(self, stages: int, regime: str = "single") -> Path:
        keys = "\n".join(f"{k} = {_toml_value(v)}" for k, v in self.keys.items())
        path = self.root / f"run-{regime}-{stages}.toml"
        model = SIZES[self.model].model_type or self.model
        how = REGIMES[regime]
        every = f"checkpoint_every_n_steps = {how.every}\nsave_every_n_steps = {how.every}" if how.every else ""
        path.write_text(RUN.format(dataset=self.dataset, model=model, path=self.path, stages=stages, keys=keys,
                                   steps=how.steps, gas=how.gas(stages), every=every, extra=self.extra,
                                   dtype=self.dtype))
        return path


def write_project(root: Path, model: str, big: bool, dataset: Path) -> Project:
    """The model (bench size or tiny) under ``root`` and its run configs on ``dataset`` (a dataset.toml).
    A model written before into the same folder (``--keep``) is reused."""
    root.mkdir(parents=True, exist_ok=True)
    written = root / "model-keys.json"
    if written.is_file() and json.loads(written.read_text()).get("model") == model:
        keys = json.loads(written.read_text())["keys"]
    else:
        keys = SIZES[model].write(root / "model", big)
        written.write_text(json.dumps({"model": model, "keys": keys}))
    return Project(root, model, root / "model", keys, dataset)


def write_dataset(root: Path, size: Size) -> Path:
    """The type's own dataset (:attr:`Size.dataset`) or 64x64 captioned images; returns its dataset.toml."""
    if size.dataset is not None:
        return size.dataset(root)
    write_image_dataset(root / "images", len(CAPTIONS), size=(64, 64), captions=CAPTIONS)
    return write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])


# ------------------------------------------------------------------------------------------------ measuring
@dataclass
class Workers:
    peaks: list[int]  # per stage (the largest worker of each stage)
    reports: list[dict]  # the workers' memory reports, by stage


def run_workers(
    project: Project, stages: int, regime: str, threads: int, timeout: float = 1800, warm: bool = False
) -> Workers:
    """One `diffpipe train` of ``stages`` stages on as many processes in ``regime``; each worker's peak anonymous
    RSS by stage. A fresh process, or with ``warm`` forked from the tests' warm server (``testing.warm_cli``: the
    libraries imported once, as the launcher imports them before it forks its CPU workers), which the suite's
    measured tests use: their runs then skip the imports, and the baseline run they subtract starts the same way."""
    config = project.config(stages, regime)
    reports = project.root / f"reports-{regime}-{stages}"
    for old in reports.glob("*.json"):
        old.unlink()
    env = cli_env(**{REPORT_ENV: str(reports), "OMP_NUM_THREADS": str(threads)})
    log_path = project.root / f"train-{regime}-{stages}.log"
    log = log_path.open("w")
    args = ["train", "--config", str(config), "--num-procs", str(stages)]
    server = warm_cli.server_for(args, env) if warm else None  # None also where only a fresh process would do
    if server is not None:
        proc: Any = server.start(args, project.root, env)
    else:
        proc = subprocess.Popen([sys.executable, "-m", "diffpipe_core.cli", *args], cwd=project.root, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    peaks: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    children: list[psutil.Process] = []
    listed = 0.0
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            # every descendant: CPU workers are forked from the launcher (its command line), NCCL ones spawned;
            # the workers' own reports name their pids, so helper processes sampled here are dropped below. Listing
            # descendants walks every process on the machine, so it is done twice a second, and the RSS read ten
            # times a second: each worker samples its own RSS every 5 ms once it reports (memory_report), and both
            # peaks are merged below
            if time.monotonic() - listed > 0.5:
                try:
                    children = psutil.Process(proc.pid).children(recursive=True)
                except psutil.NoSuchProcess:  # it ended since poll(): a warm server reaps its child at once, so
                    children = []  # its pid is gone before its exit code arrives; poll() again for that
                    time.sleep(0.05)
                    continue
                listed = time.monotonic()
            for child in children:
                try:
                    peaks[child.pid] = max(peaks.get(child.pid, 0), rss_anon(child.pid))
                except (psutil.NoSuchProcess, OSError):
                    continue
            time.sleep(0.1)
    finally:
        kill_group(proc)
        if server is not None and proc.returncode is not None:  # what the forked command printed, into the same log
            log.write("".join(proc.communicate(0)))
        log.close()
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:]
        sys.exit(f"diffpipe train ({project.model}, {stages} stages) failed:\n{tail}")
    by_rank = sorted((json.loads(p.read_text()) for p in reports.glob("rank*.json")), key=lambda r: r["rank"])
    if len(by_rank) != stages or any(r["pid"] not in peaks for r in by_rank):
        sys.exit(f"{stages} stages: {len(by_rank)} memory reports for {len(peaks)} sampled workers")
    for report in by_rank:  # the worker's own 5 ms samples, phase by phase
        own = max((p.get("peak", {}).get("rss_anon", 0) for p in report["phases"]), default=0)
        peaks[report["pid"]] = max(peaks[report["pid"]], own, *(p["rss_anon"] for p in report["phases"]))
    return Workers([peaks[r["pid"]] for r in by_rank], by_rank)


def cache(project: Project) -> None:
    result = run_diffpipe(["cache", "--config", str(project.config(1))], cwd=project.root, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"diffpipe cache ({project.model}) failed:\n{result.output[-3000:]}")


# ------------------------------------------------------------------------------------------------ reporting
def _mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def breakdown(stages: Workers, baseline: int) -> list[str]:
    """Per stage: measured peak (model memory), the estimate, RSS by phase and live tensors after the step."""
    lines = []
    for stage, (peak, report) in enumerate(zip(stages.peaks, stages.reports)):
        phases = {p["phase"]: p for p in report["phases"]}
        est = report.get("estimate", {})
        after = phases.get("step 1", {})
        tensors = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(after.get("bytes", {}).items(), key=lambda kv: -kv[1]))
        rss = ", ".join(f"{name} {_mib(p['rss_anon'])}" for name, p in phases.items())
        measured = peak - baseline
        ratio = est.get("peak_bytes", 0) / measured if measured > 0 else float("nan")
        lines.append(
            f"  stage {stage} (layers {est.get('start')}-{est.get('stop', 0) - 1}): peak {_mib(peak)} MiB, model "
            f"{_mib(measured)} MiB; estimated {_mib(est.get('peak_bytes', 0))} MiB (weights "
            f"{_mib(est.get('weight_bytes', 0))}, trainable {_mib(est.get('state_bytes', 0))}, activations "
            f"{_mib(est.get('activation_bytes', 0) + est.get('transient_bytes', 0))}, saving "
            f"{_mib(est.get('save_bytes', 0))}, heap {_mib(est.get('heap_bytes', 0))}), estimate/measured {ratio:.2f}"
        )
        lines.append(f"    RssAnon MiB by phase: {rss}")
        sampled = [p for p in report["phases"] if p.get("peak", {}).get("rss_anon")]
        if sampled:  # the worker's own sampler: the phase its peak fell in, and the C heap at that moment
            top = max(sampled, key=lambda p: p["peak"]["rss_anon"])
            base = phases.get("built", {})
            lines.append(
                f"    peak inside {top['phase']}: RssAnon {_mib(top['peak']['rss_anon'])} MiB; C heap live "
                f"{_mib(top['peak']['heap_live'])} MiB (built: {_mib(base.get('heap_live', 0))}), free in its arenas "
                f"{_mib(top['peak']['heap_free'])} MiB (built: {_mib(base.get('heap_free', 0))})"
            )
        lines.append(f"    live tensors after the step, MiB: {tensors}")
        if after.get("largest_other"):
            lines.append(f"    largest other tensors: {'; '.join(after['largest_other'][:3])}")
    return lines


TARGETS = {2: 0.55, 4: 0.30}


def estimate_ratios(workers: Workers, baseline: int) -> list[float]:
    """Per stage: the plan's estimated peak over the measured model memory (peak less the idle baseline)."""
    return [r.get("estimate", {}).get("peak_bytes", 0) / max(peak - baseline, 1)
            for peak, r in zip(workers.peaks, workers.reports)]  # fmt: skip


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def measure(
    big: Project, tiny: Project, regime: str, layouts: list[int], rounds: int, threads: int, timeout: float = 1800
) -> None:
    """Every layout in ``regime`` for ``rounds`` rounds (the order reversed every other round): shares, each
    stage's estimate over measured, and where the memory goes in the last round; ``timeout``: seconds per run."""
    print(f"regime {regime}: {REGIMES[regime].note}", flush=True)
    baselines = {n: max(run_workers(tiny, n, regime, threads).peaks) for n in layouts}
    print("  idle worker baseline (tiny model), largest worker MiB: "
          + ", ".join(f"{n} stage{'s' if n > 1 else ''} {_mib(b)}" for n, b in baselines.items()), flush=True)
    shares: dict[int, list[float]] = {n: [] for n in layouts if n > 1}
    ratios: dict[int, list[list[float]]] = {n: [] for n in layouts}
    last: dict[int, Workers] = {}
    for r in range(rounds):
        order = layouts if r % 2 == 0 else layouts[::-1]
        got = {n: run_workers(big, n, regime, threads, timeout) for n in order}
        last = got
        one = got[1].peaks[0] - baselines[1]
        for n in layouts:
            ratios[n].append(estimate_ratios(got[n], baselines[n]))
        parts = [f"1 stage {_mib(got[1].peaks[0])} (est/meas {ratios[1][-1][0]:.2f})"]
        for n in shares:
            share = (max(got[n].peaks) - baselines[n]) / one
            shares[n].append(share)
            est = " ".join(f"{x:.2f}" for x in ratios[n][-1])
            parts.append(f"{n} stages [{' '.join(_mib(p) for p in got[n].peaks)}] share {share:.3f} (est/meas {est})")
        print(f"  round {r + 1} ({'->'.join(map(str, order))}), peak RssAnon per worker MiB: " + "; ".join(parts)
              + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    for n, values in shares.items():
        target = f"; target <= {TARGETS[n]:.2f}" if n in TARGETS else ""
        print(f"  {n} stages: largest stage's share of the 1-stage model memory: median "
              f"{_spread(values)} over {len(values)} rounds{target}")
    for n in layouts:
        per_stage = [_spread([r[s] for r in ratios[n]]) for s in range(n)]
        print(f"  {n} stage{'s' if n > 1 else ''}: estimate / measured per stage, median (spread): "
              + "; ".join(per_stage) + " (target 0.85-1.15)")
    print("  where the memory goes (last round; MiB; model memory = peak - idle baseline of that layout):")
    for n in layouts:
        print(f"   {n} stage{'s' if n > 1 else ''}:")
        for line in breakdown(last[n], baselines[n]):
            print("  " + line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all layouts (at least 3)")
    parser.add_argument("--layouts", default="1,2,4", help="stage counts; 1 is always measured")
    parser.add_argument("--regimes", default="users,single",
                        help=f"how each run trains, in turn: {', '.join(REGIMES)} (see REGIMES)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per worker (OMP_NUM_THREADS)")
    parser.add_argument("--smoke", action="store_true", help="one round of the tiny model: checks the bench runs")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one run may take (a 4-stage step of a 0.7 B model takes minutes on 2 cores)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work in this folder and keep it (a model written there before is reused)")
    args = parser.parse_args()
    layouts = sorted({1, *(int(s) for s in args.layouts.split(","))})
    regimes = args.regimes.split(",")
    if unknown := [r for r in regimes if r not in REGIMES]:
        sys.exit(f"--regimes: unknown {', '.join(unknown)}; valid: {', '.join(REGIMES)}")
    if not args.smoke and args.rounds < 3:
        sys.exit("--rounds: at least 3 rounds are needed for a median and a spread")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="diffpipe-stage-memory-") as tmp:
        root = args.keep or Path(tmp)
        dataset = write_dataset(root, SIZES[args.model])
        t0 = time.monotonic()
        big = write_project(root / "big", args.model, not args.smoke, dataset)
        tiny = write_project(root / "tiny", args.model, False, dataset)
        cache(big)
        cache(tiny)
        print(f"model: {args.model}, {SIZES[args.model].note if not args.smoke else 'tiny (smoke)'}; written and "
              f"cached in {time.monotonic() - t0:.0f} s; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs, {args.threads} thread(s) per worker", flush=True)
        for regime in regimes:
            measure(big, tiny, regime, layouts, 1 if args.smoke else args.rounds, args.threads, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
