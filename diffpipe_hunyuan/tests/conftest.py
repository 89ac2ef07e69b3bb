"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny HunyuanVideo written to disk per
session (diffusers folder + original-layout single file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def tiny_hunyuan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HunyuanVideo folder; its original-layout file is ``diffpipe_hunyuan.testing.original_path(folder)``."""
    from diffpipe_hunyuan.testing import write_tiny_hunyuan

    return write_tiny_hunyuan(tmp_path_factory.mktemp("hunyuan") / "tiny-hunyuan")


@pytest.fixture(scope="session")
def crop_start() -> int:
    """``text_crop_start`` for the tiny model's Llama tokenizer."""
    from diffpipe_hunyuan.testing import llama_tokenizer, template_crop_start

    return template_crop_start(llama_tokenizer())


@pytest.fixture(scope="session")
def tiny_hunyuan15(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HunyuanVideo-1.5 text-to-video folder (``HunyuanVideo15Pipeline``); its Tencent-layout file is
    ``diffpipe_hunyuan.testing15.original_path(folder)``."""
    from diffpipe_hunyuan.testing15 import write_tiny_hunyuan15

    return write_tiny_hunyuan15(tmp_path_factory.mktemp("hunyuan15") / "tiny-hunyuan15")


@pytest.fixture(scope="session")
def tiny_hunyuan15_i2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HunyuanVideo-1.5 image-to-video folder (``HunyuanVideo15ImageToVideoPipeline``, with SigLIP)."""
    from diffpipe_hunyuan.testing15 import write_tiny_hunyuan15

    return write_tiny_hunyuan15(tmp_path_factory.mktemp("hunyuan15-i2v") / "tiny-hunyuan15-i2v", i2v=True)


@pytest.fixture(scope="session")
def crop_start15() -> int:
    """``text_crop_start`` for the tiny HunyuanVideo-1.5's Qwen tokenizer."""
    from diffpipe_hunyuan.testing15 import qwen_tokenizer, template_crop_start

    return template_crop_start(qwen_tokenizer())


@pytest.fixture(scope="session")
def hunyuan15_run(tmp_path_factory: pytest.TempPathFactory, tiny_hunyuan15: Path) -> Path:
    """The shared ``hunyuan-video-1.5`` run (test_hunyuan15_train.py's project): mixed clips and images, 1 process,
    from Tencent's single file. Returns its run folder."""
    from test_hunyuan15_train import train_project

    return train_project(tmp_path_factory.mktemp("hunyuan15-run"), "hunyuan-video-1.5", tiny_hunyuan15)


@pytest.fixture(scope="session")
def hunyuan15_i2v_run(tmp_path_factory: pytest.TempPathFactory, tiny_hunyuan15_i2v: Path) -> Path:
    """The shared ``hunyuan-video-1.5-i2v`` run: mixed clips (first-frame conditioned) and images, 1 process, from
    the diffusers folder. Returns its run folder."""
    from test_hunyuan15_train import train_project

    return train_project(tmp_path_factory.mktemp("hunyuan15-i2v-run"), "hunyuan-video-1.5-i2v", tiny_hunyuan15_i2v)


@pytest.fixture(scope="session")
def tiny_hunyuan_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HunyuanImage-2.1 folder (``HunyuanImagePipeline``); its Tencent-layout file is
    ``diffpipe_hunyuan.testing21.original_path(folder)``."""
    from diffpipe_hunyuan.testing21 import write_tiny_hunyuan_image

    return write_tiny_hunyuan_image(tmp_path_factory.mktemp("hunyuan-image") / "tiny-hunyuan-image")


@pytest.fixture(scope="session")
def tiny_hunyuan_image_distilled(tiny_hunyuan_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_hunyuan_image`` with the guidance-distilled MeanFlow transformer and no guider (the distilled
    checkpoint's folder)."""
    from diffpipe_hunyuan.testing21 import as_distilled

    return as_distilled(tiny_hunyuan_image, tmp_path_factory.mktemp("hunyuan-image") / "distilled")


@pytest.fixture(scope="session")
def hunyuan_image_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared ``hunyuan-image-2.1`` run (test_hunyuan_image_train.py's project), 1 process. Its run folder."""
    from test_hunyuan_image_train import train_project

    return train_project(tmp_path_factory.mktemp("hunyuan-image-run"))
