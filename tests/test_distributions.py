"""Distributions, from a user's side (issue 8, acceptance 1 and 3).

One clean virtualenv per module: wheels of diffpipe-core and diffpipe-flux are built from a copy of the
sources and pip-installed from a local wheel folder alone. Then ``diffpipe models`` lists flux and a tiny
``diffpipe train --model flux`` runs; and ``diffpipe plugin new`` renders the template (image and
video), the rendered packages pass their own tests, install with pip, show up in
``diffpipe models``, the video one trains 2 pipeline stages on images and a video with masks (so image
and video batches share one run), and both uninstall.

The template plugins go into this clean virtualenv rather than the suite's own: several suites share
that one, and a model appearing in it mid-run would change what their ``diffpipe models`` print.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from diffpipe_core.engine.run_dir import train_losses
from diffpipe_core.scaffold import render_plugin
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset, write_png, write_video
from diffpipe_core.testing.processes import cli_env, run_diffpipe, write_plugin_distribution

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {  # distribution -> what its wheel is built from (relative to ROOT)
    "core": ["pyproject.toml", "README.md", "diffpipe_core", "plugins/template"],
    "flux": ["diffpipe_flux/pyproject.toml", "diffpipe_flux/README.md", "diffpipe_flux/src"],
}


def run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def copy_sources(dest: Path) -> None:
    """Build from a copy, so building writes nothing (build/, *.egg-info) into the checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for rel in (r for rels in SOURCES.values() for r in rels):
        src, out = ROOT / rel, dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, symlinks=True, ignore=ignore)  # keeps the plugin_template symlink a link
        else:
            shutil.copy2(src, out)


# Imported into the clean venv from their real paths, third-party packages behave exactly as in the suite's
# venv; paths matter: DeepSpeed JIT-compiles a CPU comm op into the shared torch-extensions folder keyed by
# a build command holding its own and torch's paths, and under other paths it would rebuild (about 80 s)
# and make the suite's next run rebuild again.
SUITE_IMPORTS = """
import sys
from importlib.machinery import PathFinder


class SuiteSitePackages:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is not None or name.startswith("diffpipe"):
            return None
        return PathFinder.find_spec(name, [{site!r}])


sys.meta_path.insert(0, SuiteSitePackages)
"""


def dependency_farm(farm: Path) -> list[str]:
    """Third-party packages for the clean venv without a network; returns the lines of a ``.pth`` file.

    A ``.pth`` can only add whole folders to ``sys.path``, and the suite's site-packages also holds
    diffpipe's own (editable) distributions, which must not leak in. So: ``farm`` gets symlinks to the
    ``*.dist-info`` folders of every non-diffpipe distribution there (what ``importlib.metadata`` and pip's
    resolver read: the wheels' declared dependencies resolve against them, offline), and a meta-path finder
    (SUITE_IMPORTS) imports every non-diffpipe top-level module from the suite's site-packages itself. The
    venv's ``diffpipe*`` modules come only from the wheels installed into it.
    """
    site = Path(sysconfig.get_paths()["purelib"])
    farm.mkdir()
    for entry in site.glob("*.dist-info"):
        if not entry.name.lower().startswith("diffpipe"):
            (farm / entry.name).symlink_to(entry)
    (farm / "_suite_site_packages.py").write_text(SUITE_IMPORTS.format(site=str(site)))
    return [str(farm), "import _suite_site_packages"]


class CleanVenv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.python = root / "bin" / "python"
        self.diffpipe = root / "bin" / "diffpipe"
        self.site = Path(
            run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
        )

    def pip(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        # the suite's pip drives the venv's interpreter (pip --python); the venv itself has no pip
        return run([sys.executable, "-m", "pip", "--python", str(self.python), "--no-input", *args], timeout=timeout)

    def env(self, extra_paths: list[Path] | None = None) -> dict[str, str]:
        env = cli_env(extra_paths)
        if not extra_paths:
            env.pop("PYTHONPATH", None)  # nothing of the checkout may leak in
        env.pop("VIRTUAL_ENV", None)
        return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> CleanVenv:
    root = tmp_path_factory.mktemp("dist")
    copy_sources(root / "src")
    wheels = root / "wheels"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(wheels),
            str(root / "src"),
            str(root / "src" / "diffpipe_flux"),
        ],
        timeout=400,
    )
    assert sorted(p.name.split("-")[0] for p in wheels.glob("*.whl")) == ["diffpipe_core", "diffpipe_flux"]
    run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")])
    env = CleanVenv(root / "venv")
    (env.site / "diffpipe-test-deps.pth").write_text("\n".join(dependency_farm(root / "deps")) + "\n")
    # from the local wheel folder alone; the declared dependencies resolve against the farm
    env.pip("install", "-q", "--no-index", "--find-links", str(wheels), "diffpipe-core", "diffpipe-flux")
    return env


def test_wheels_install_into_a_clean_venv_and_flux_trains(venv: CleanVenv, tmp_path: Path) -> None:
    where = run(
        [
            str(venv.python),
            "-c",
            "import diffpipe_core, diffpipe_flux; print(diffpipe_core.__file__, diffpipe_flux.__file__)",
        ],
        env=venv.env(),
        cwd=tmp_path,
    ).stdout.split()
    assert all(Path(p).is_relative_to(venv.site) for p in where), where  # the wheels, not the checkout

    models = run_diffpipe(["models"], tmp_path, timeout=120, env=venv.env(), program=venv.diffpipe)
    assert models.returncode == 0, models.output
    flux_row = next(line for line in models.stdout.splitlines() if line.startswith("flux "))
    assert "diffpipe-flux" in flux_row and flux_row.rstrip().endswith("ok"), models.stdout
    new = run_diffpipe(["plugin", "new", "fromwheel", "--dir", "new"], tmp_path, 120, venv.env(), venv.diffpipe)
    assert new.returncode == 0 and (tmp_path / "new/diffpipe-fromwheel/src/diffpipe_fromwheel/plugin.py").is_file()

    from diffpipe_flux.testing import TinyFluxConfig, write_tiny_flux

    write_tiny_flux(tmp_path / "model", TinyFluxConfig(num_layers=1, num_single_layers=1))
    write_image_dataset(tmp_path / "images", 2, size=(32, 32), captions=["a red cat", "a blue dog"])
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "images", resolutions=[32])
    (tmp_path / "run.toml").write_text(
        'output_dir = "out"\ndataset = "dataset.toml"\nmax_steps = 2\nmicro_batch_size_per_gpu = 1\n'
        'gradient_accumulation_steps = 1\npipeline_stages = 1\n\n[model]\ntype = "flux"\npath = "model"\n'
        'dtype = "float32"\nencoder_dtype = "float32"\nt5_max_length = 8\n\n[adapter]\nrank = 4\nalpha = 4\n'
    )
    result = run_diffpipe(
        ["train", "--config", "run.toml", "--num-procs", "1"],
        tmp_path,
        timeout=400,
        env=venv.env(),
        program=venv.diffpipe,
    )
    assert result.returncode == 0, result.output[-4000:]
    run_dir = next((tmp_path / "out").iterdir())
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), losses
    assert (run_dir / "saved" / "final" / "adapter_model.safetensors").is_file()
    info = json.loads((run_dir / "run_info.json").read_text())
    assert "diffpipe-flux" in json.dumps(info)


OBSERVER = """
import json, os
import click
from diffpipe_core import hookimpl

@hookimpl
def register_commands(cli):
    @cli.command("observer-ping")
    def ping():
        click.echo("observer: pong")

@hookimpl
def on_train_step_end(step, metrics):
    with open(os.environ["OBSERVER_OUT"], "a") as f:
        f.write(json.dumps({"step": step, "loss": metrics["loss"]}) + "\\n")
"""


def write_mixed_dataset(root: Path) -> Path:
    """3 images and one 8-frame 16 fps video (5 frames after resampling to the model's 16 fps... the
    bucket 4k + 1 = 5), each with a loss mask the size of its media."""
    write_image_dataset(root / "media", 3, size=(32, 32), captions=["a red cat", "a blue dog", "a tree"])
    write_video(root / "media" / "clip.mp4", frames=8, fps=16, size=(32, 32))
    (root / "media" / "clip.txt").write_text("a moving river")
    (root / "masks").mkdir()
    for i, stem in enumerate(["img_000", "img_001", "img_002", "clip"]):
        write_png(root / "masks" / f"{stem}.png", 32, 32, seed=50 + i)
    return write_dataset_toml(
        root / "dataset.toml", root / "media", {"mask_path": root / "masks"}, resolutions=[32], frame_buckets=[1, 5]
    )


def rendered_module(pkg: Path, name: str):
    """A rendered package's module, imported in this process from its sources (it is installed only in the clean
    venv); its uniquely named package stays importable, no entry point of it is seen here."""
    sys.path.insert(0, str(pkg / "src"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(pkg / "src"))


def test_template_renders_installs_trains_two_stages_and_uninstalls(venv: CleanVenv, tmp_path: Path) -> None:
    pkgs = {
        "image": render_plugin("tplimage", tmp_path / "pkgs"),
        "video": render_plugin("tplvideo", tmp_path / "pkgs", video=True),
    }
    # their own tests pass as created (run from the sources, against the wheel-installed core)
    tests = run(
        [str(venv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(p / "tests") for p in pkgs.values())],
        env=venv.env([p / "src" for p in pkgs.values()]),
        cwd=tmp_path / "pkgs",
        timeout=300,
    )
    assert " passed" in tests.stdout and "failed" not in tests.stdout, tests.stdout[-2000:]

    venv.pip("install", "-q", "--no-deps", "--no-build-isolation", "--no-index", *map(str, pkgs.values()))
    observer = write_plugin_distribution(
        tmp_path / "observer",
        "diffpipe-observer",
        {"diffpipe.plugins": {"observer": "observer"}},
        {"observer": OBSERVER},
    )
    env = venv.env([observer])
    env["OBSERVER_OUT"] = str(tmp_path / "observed.jsonl")
    models = run_diffpipe(["models"], tmp_path, timeout=120, env=env, program=venv.diffpipe)
    rows = {line.split()[0]: line for line in models.stdout.splitlines()[1:]}
    for name, kind in (("tplimage", "image"), ("tplvideo", "video"), ("flux", "image")):
        assert name in rows and rows[name].split()[1] == kind and rows[name].rstrip().endswith("ok"), models.stdout
    assert "diffpipe-tplvideo" in rows["tplvideo"]
    ping = run_diffpipe(["observer-ping"], tmp_path, timeout=120, env=env, program=venv.diffpipe)
    assert ping.returncode == 0 and "observer: pong" in ping.stdout, ping.output  # register_commands

    rendered_module(pkgs["video"], "diffpipe_tplvideo.testing").write_tiny_model(tmp_path / "model")
    write_mixed_dataset(tmp_path)
    (tmp_path / "run.toml").write_text(
        'output_dir = "out"\ndataset = "dataset.toml"\nmax_steps = 4\nmicro_batch_size_per_gpu = 1\n'
        'gradient_accumulation_steps = 2\npipeline_stages = 2\n\n[model]\ntype = "tplvideo"\npath = "model"\n'
        'dtype = "float32"\nencoder_dtype = "float32"\n\n'
        "[adapter]\nrank = 4\nalpha = 4\n\n[optimizer]\nlr = 1e-3\n"
    )
    result = run_diffpipe(
        ["train", "--config", "run.toml", "--num-procs", "2"], tmp_path, timeout=500, env=env, program=venv.diffpipe
    )
    assert result.returncode == 0, result.output[-4000:]
    assert re.search(r"cache: 4 items .*skipped 0", result.output), result.output[-4000:]  # the video too
    run_dir = next((tmp_path / "out").iterdir())
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values()), losses
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert sorted(p.name for p in ckpt.glob("params-stage*.safetensors")) == [
        "params-stage0.safetensors",
        "params-stage1.safetensors",
    ]
    assert (run_dir / "saved" / "final" / "adapter_model.safetensors").is_file()
    observed = [json.loads(line) for line in (tmp_path / "observed.jsonl").read_text().splitlines()]
    assert [o["step"] for o in observed] == [1, 2, 3, 4]  # on_train_step_end, rank 0, once per step

    venv.pip("uninstall", "-y", "-q", "diffpipe-tplimage", "diffpipe-tplvideo")
    left = [p.name for p in venv.site.iterdir() if "tpl" in p.name]
    assert not left, left
