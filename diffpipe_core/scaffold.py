"""``diffpipe plugin new``: render the plugin template into an installable package.

The template (``plugins/template/`` in the repository, shipped in the wheel as
``diffpipe_core/plugin_template/``) holds ``{{key}}`` placeholders in file contents and paths; that is
why the root ``pyproject.toml`` keeps it out of ruff. Rendered, it is plain Python (a test runs ruff and
the rendered package's own tests on it).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def template_dir() -> Path:
    """The template folder: inside the installed package (wheel), else the repository's ``plugins/template``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "plugin_template", here.parent / "plugins" / "template"):
        if (candidate / "pyproject.toml").is_file():
            return candidate
    raise FileNotFoundError(
        f"the plugin template is missing: neither {here / 'plugin_template'} nor "
        f"{here.parent / 'plugins' / 'template'} holds a pyproject.toml"
    )


def template_values(name: str, video: bool) -> dict[str, str]:
    """The placeholder values for model ``name``; raises ValueError for a name that cannot be a package.

    ``name`` stays the entry-point (model) name users type, ``-`` included (``qwen-image``, like the bundled
    ``hunyuan-video``); the package is ``diffpipe_<name>`` with ``-`` as ``_`` (``diffpipe_qwen_image``)."""
    if not NAME_RE.match(name) or name.endswith(("-", "_")) or "--" in name:
        raise ValueError(
            f"model name {name!r} is not valid: use up to 32 lowercase letters, digits, '-' and '_', starting with a "
            "letter and ending with a letter or digit (it becomes the entry-point name and the package "
            "diffpipe_<name>, '-' read as '_')"
        )
    from diffpipe_core import CONTRACT_VERSION
    from diffpipe_core.plugin_clashes import NAMING
    from diffpipe_core.registry import DISTRIBUTIONS

    module = name.replace("-", "_")
    distribution = f"diffpipe-{module.replace('_', '-')}"
    if name in DISTRIBUTIONS or distribution in DISTRIBUTIONS.values():
        raise ValueError(
            f"model name {name!r} is diffpipe's own ({DISTRIBUTIONS.get(name, distribution)} ships it): {NAMING} "
            f"(e.g. acme-{name})"
        )
    modality = "video" if video else "image"
    return {
        "name": name,
        "module": module,
        "package": f"diffpipe_{module}",
        "distribution": distribution,
        "class_name": "".join(part.capitalize() for part in module.split("_")),
        "modality": modality,
        "video": str(video),
        "video_frames": "(4, 1, 16.0)" if video else "None",
        "vae_class": "AutoencoderKLHunyuanVideo" if video else "AutoencoderKL",
        "vae_builder": "hunyuan_video_vae" if video else "autoencoder_kl",
        "contract": str(CONTRACT_VERSION),
        "description": f"tiny {modality} DiT on diffusers parts, from diffpipe's plugin template",
    }


def _fill(text: str, values: dict[str, str], where: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise KeyError(f"{where}: unknown placeholder {m.group(0)}; known: {', '.join(values)}")
        return values[m.group(1)]

    return PLACEHOLDER.sub(sub, text)


def render_plugin(name: str, dest_dir: Path, video: bool = False, template: Path | None = None) -> Path:
    """Render the template for model ``name`` into ``dest_dir/diffpipe-<name>`` and return that folder.

    Refuses an existing target. The package is written to a temporary folder beside it and renamed into
    place, so a failed render leaves nothing behind.
    """
    values = template_values(name, video)
    src = template or template_dir()
    dest_dir = Path(dest_dir)
    target = dest_dir / values["distribution"]
    if target.exists():
        raise FileExistsError(f"{target} already exists; choose another --dir or remove it")
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=dest_dir))
    try:
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src)
            if not path.is_file() or "__pycache__" in rel.parts or path.suffix == ".pyc":
                continue
            out = tmp / _fill(str(rel), values, str(rel))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(_fill(path.read_text(encoding="utf-8"), values, str(path)), encoding="utf-8")
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
