"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); the tiny Wan variants written to disk once per
session (diffusers folders + original-layout single files, ``diffpipe_wan.testing.single_file_path``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


def _write(factory: pytest.TempPathFactory, name: str, **variant) -> Path:
    from diffpipe_wan.testing import TinyWanConfig, write_tiny_wan

    return write_tiny_wan(factory.mktemp("wan") / name, TinyWanConfig(**variant))


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wan 2.1 text-to-video (``WanPipeline``)."""
    return _write(tmp_path_factory, "tiny-wan")


@pytest.fixture(scope="session")
def tiny_wan_a14b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wan 2.2 A14B text-to-video: two experts, ``boundary_ratio`` 0.875."""
    return _write(tmp_path_factory, "tiny-wan-a14b", boundary_ratio=0.875)


@pytest.fixture(scope="session")
def tiny_wan_i2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wan 2.1 image-to-video (``WanImageToVideoPipeline``, CLIP vision encoder)."""
    return _write(tmp_path_factory, "tiny-wan-i2v", i2v=True, clip=True)


@pytest.fixture(scope="session")
def tiny_wan_flf2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wan 2.1 first-last-frame-to-video (CLIP vision, the image embedder's two-image ``pos_embed``)."""
    return _write(tmp_path_factory, "tiny-wan-flf2v", i2v=True, clip=True, flf2v=True)


@pytest.fixture(scope="session")
def tiny_wan_a14b_i2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wan 2.2 I2V A14B: two image-to-video experts (no CLIP), ``boundary_ratio`` 0.9."""
    return _write(tmp_path_factory, "tiny-wan-a14b-i2v", i2v=True, boundary_ratio=0.9)


@pytest.fixture(scope="session")
def tiny_wan_ti2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wan 2.2 TI2V: the 16x VAE, ``expand_timesteps``."""
    return _write(tmp_path_factory, "tiny-wan-ti2v", vae22=True)


@pytest.fixture(scope="session")
def wan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared ``wan`` run (test_wan_train.py's project): mixed clips and images, 1 stage in 1 process from the
    original-layout single file, sampling once before the first step. Returns its run folder."""
    from test_wan_train import make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("wan-run")
    return runs.train(root, make_project(root), procs=1, timeout=600, OMP_NUM_THREADS="1")


def _write_skyreels(factory: pytest.TempPathFactory, variant: str, **kw) -> Path:
    from diffpipe_wan.skyreels_testing import write_tiny_skyreels

    return write_tiny_skyreels(factory.mktemp("skyreels") / f"tiny-skyreels-{variant}", variant, **kw)


@pytest.fixture(scope="session")
def tiny_skyreels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SkyReels V2 text-to-video (``SkyReelsV2Pipeline``)."""
    return _write_skyreels(tmp_path_factory, "t2v")


@pytest.fixture(scope="session")
def tiny_skyreels_df(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SkyReels V2 diffusion forcing (``SkyReelsV2DiffusionForcingPipeline``), with the frame-rate embedding."""
    return _write_skyreels(tmp_path_factory, "df", fps=True)


@pytest.fixture(scope="session")
def tiny_skyreels_i2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SkyReels V2 image-to-video (``SkyReelsV2ImageToVideoPipeline``, CLIP vision encoder)."""
    return _write_skyreels(tmp_path_factory, "i2v")


@pytest.fixture(scope="session")
def skyreels_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared ``skyreels-v2`` diffusion-forcing run (test_skyreels_train.py's project). Returns its run folder."""
    from test_skyreels_train import make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("skyreels-run")
    return runs.train(root, make_project(root), procs=1, timeout=600, OMP_NUM_THREADS="1")
@pytest.fixture(scope="session")
def tiny_wan_vace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wan 2.1 VACE (``WanVACEPipeline``): VACE blocks at layers 0 and 2 of 3."""
    return _write(tmp_path_factory, "tiny-wan-vace", vace=True)


@pytest.fixture(scope="session")
def tiny_wan_fun(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wan 2.1 Fun-Control: a ``WanPipeline`` whose transformer takes 3z channels."""
    from diffpipe_wan.testing import write_tiny_wan_fun

    return write_tiny_wan_fun(tmp_path_factory.mktemp("wan") / "tiny-wan-fun")
