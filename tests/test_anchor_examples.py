"""Every example config of tdrussell/diffusion-pipe and every ``[model]`` snippet of its docs/supported_models.md
through ``diffpipe import-config`` (issue 43).

The fixtures in ``tests/anchor_examples/`` are the anchor's own texts at 8f83dbf (``examples/*.toml`` verbatim; the
``[model]`` code blocks of the docs with their headings). Each conversion keeps every key diffpipe has a counterpart
for, keeps edit and image-to-video settings, maps every model type to a diffpipe model (or names the distribution that
will have it), and, with tiny models standing in for the paths, passes ``diffpipe validate``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

from diffpipe_core.anchor.convert import Imported, import_config
from diffpipe_core.anchor.keys import core_fields
from diffpipe_core.anchor.models import EDIT_VARIANTS, MODEL_TYPES, PATH_NOTES, PLANNED
from diffpipe_core.cli import main
from diffpipe_core.registry import get_registry
from diffpipe_core.testing.media import write_image_dataset

EXAMPLES = Path(__file__).parent / "anchor_examples"
RUN_CONFIGS = sorted(p.name for p in EXAMPLES.glob("*.toml") if "dataset" not in p.name)
DATASETS = sorted(p.name for p in EXAMPLES.glob("*.toml") if "dataset" in p.name)
SNIPPETS = re.findall(r"## ([^\n]+)\n```toml\n(.*?)```", (EXAMPLES / "supported_models.md").read_text(), re.S)
SNIPPET_IDS = [f"{i}-{re.sub(r'[^A-Za-z0-9.]+', '-', heading)}" for i, (heading, _) in enumerate(SNIPPETS)]
# the model types diffusion-pipe's train.py dispatches on, at 8f83dbf
ANCHOR_TYPES = (
    "flux", "ltx-video", "hunyuan-video", "sdxl", "cosmos", "lumina_2", "wan", "chroma", "hidream", "sd3",
    "cosmos_predict2", "anima", "omnigen2", "qwen_image", "hunyuan_image", "auraflow", "z_image", "hunyuan_video_15",
    "flux2", "ernie_image", "ltx2", "ideogram4", "krea2", "minimax_h3",
)  # fmt: skip
# ComfyUI component-file keys: the lead maps them onto [model] diffusion_model, vae, text_encoders, audio_vae (issue 35)
COMPONENT_KEYS = {"diffusion_model", "vae", "text_encoders", "text_encoder", "audio_vae"}
SECTION_OF = {None: "run", "[model]": "model", "[adapter]": "adapter", "[optimizer]": "optimizer",
              "[logging]": "logging", "[[directory]]": "directory"}


def _installed() -> set[str]:
    return {info.name for info in get_registry().models() if info.ok}


def _not_carried(text: str, top: str) -> list[tuple[str, str]]:
    """``(section, key)`` of every ``# not carried: key = ...`` (or ``[key]``) note of a written file."""
    found, section = [], top
    for line in text.splitlines():
        if line.startswith("["):
            section = SECTION_OF.get(line.strip(), line.strip())
        match = re.match(r"# not carried: \[?([A-Za-z0-9_]+)", line)
        if match:
            found.append((section, match.group(1)))
    return found


def _fields(section: str, model: str | None) -> set[str]:
    if section == "model":
        return set(get_registry().model(model).spec.config_schema.model_fields) if model else set()
    if section == "logging":
        from diffpipe_core.config import LoggingConfig

        return set(LoggingConfig.model_fields)
    return core_fields(section) or set()


def _check_nothing_diffpipe_has_is_dropped(imported: Imported) -> dict:
    """Every key the importer did not carry is one diffpipe has no key for (where the anchor had it); returns the
    run config written."""
    run = tomllib.loads(imported.files["run.toml"])
    model = run["model"].get("type") if run["model"].get("type") in _installed() else None
    for name, text in imported.files.items():
        for section, key in _not_carried(text, "run" if name == "run.toml" else "dataset"):
            if section == "dataset" and key in ("control_path", "default_mask_file"):
                continue  # diffusion-pipe reads these per [[directory]] only: at the top level they did nothing
            if section == "directory" and key == "subsample_ratio":
                continue  # likewise, the other way round
            assert key not in _fields(section, model), f"{name}: {section}.{key} has a diffpipe counterpart"
    return run


def _in_main_example(model: str) -> str:
    """examples/main_example.toml with its [model] table replaced by ``model`` (a snippet is one table of a run
    config: the docs show it for main_example's place)."""
    text = (EXAMPLES / "main_example.toml").read_text()
    start, end = text.index("\n[model]\n"), text.index("\n[adapter]\n")
    return text[:start] + "\n" + model + text[end:]


def _convert(tmp_path: Path, run_text: str, dataset: Path | None) -> Imported:
    config = tmp_path / "anchor.toml"
    config.write_text(run_text)
    return import_config(config, tmp_path, dataset)


def _validate(tmp_path: Path, run_text: str, dataset_text: str):
    """``diffpipe validate`` on an imported run.toml and dataset.toml, written under ``tmp_path/converted``."""
    out = tmp_path / "converted"
    out.mkdir()
    (out / "run.toml").write_text(run_text)
    (out / "dataset.toml").write_text(dataset_text)
    return CliRunner().invoke(main, ["validate", "--config", str(out / "run.toml")])


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("run_config", RUN_CONFIGS)
def test_every_example_config_converts_keeping_what_diffpipe_has(tmp_path: Path, run_config: str,
                                                                  dataset: str) -> None:
    imported = import_config(EXAMPLES / run_config, tmp_path, EXAMPLES / dataset)
    run = _check_nothing_diffpipe_has_is_dropped(imported)
    data = tomllib.loads(imported.files["dataset.toml"])
    anchor_run, anchor_data = (tomllib.loads((EXAMPLES / f).read_text()) for f in (run_config, dataset))
    edit_dirs = [d for d in anchor_data.get("directory", []) if "control_path" in d]
    for ours, theirs in zip(data["directory"], anchor_data["directory"]):  # edit pairs stay edit pairs
        assert ours.get("control_path") == theirs.get("control_path")
    family = MODEL_TYPES.get(anchor_run["model"]["type"])
    if edit_dirs and family in EDIT_VARIANTS:
        assert run["model"]["type"] == EDIT_VARIANTS[family], "an edit dataset trained as text-to-image"
        assert PATH_NOTES.get(run["model"]["type"], "") in imported.files["run.toml"]  # which folder path takes
    if "size_buckets" in anchor_data:
        assert data["size_buckets"] == anchor_data["size_buckets"]
    if anchor_run["model"].get("transformer_dtype") == "float8":
        assert run["model"]["quantize"] == "float8"


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=SNIPPET_IDS)
def test_every_model_snippet_converts_to_a_diffpipe_model(tmp_path: Path, index: int) -> None:
    heading, body = SNIPPETS[index]
    imported = _convert(tmp_path, _in_main_example(body), EXAMPLES / "dataset.toml")
    run = _check_nothing_diffpipe_has_is_dropped(imported)
    anchor = tomllib.loads(body)["model"]
    name = run["model"]["type"]
    if anchor["type"] in PLANNED:
        assert f"the {PLANNED[anchor['type']]} distribution will have it" in imported.files["run.toml"]
    else:
        assert name in _installed(), f"{heading}: type = {anchor['type']!r} became {name!r}, not an installed model"
    quantized = anchor.get("transformer_dtype", anchor.get("diffusion_model_dtype"))
    if quantized in ("float8", "float8_e5m2"):
        assert run["model"]["quantize"] == quantized
    for key, value in anchor.items():  # the keys this model's diffpipe table has keep their value
        if name in _installed() and key in _fields("model", name) and key not in ("type", "dtype"):
            if key == "text_encoders":  # a {paths = [...]} entry (one ComfyUI loader of several files): one per file
                value = [{"path": p, "type": e["type"]} for e in value for p in e.get("paths", [e.get("path")])]
            assert run["model"][key] == value, key


def test_every_anchor_model_type_has_a_diffpipe_name_or_a_planned_distribution() -> None:
    assert set(MODEL_TYPES) | set(PLANNED) == set(ANCHOR_TYPES)
    assert set(MODEL_TYPES.values()) <= _installed()
    assert all(dist.startswith("diffpipe-") for dist in PLANNED.values())


def _stand_ins(root: Path) -> dict[str, tuple[Path, Path | None]]:
    """Tiny models standing in for the snippets' files: model -> (diffusers folder, single transformer file)."""
    from diffpipe_auraflow.testing import original_path as auraflow_file
    from diffpipe_auraflow.testing import write_tiny_auraflow
    from diffpipe_cosmos.testing import TinyCosmosConfig, write_tiny_cosmos
    from diffpipe_cosmos.testing import original_path as cosmos_file
    from diffpipe_cosmos.testing_anima import comfy_path as anima_file
    from diffpipe_cosmos.testing_anima import write_tiny_anima
    from diffpipe_flux.testing import bfl_path, write_tiny_chroma, write_tiny_flux
    from diffpipe_hidream.testing import comfy_path as hidream_file
    from diffpipe_hidream.testing import write_tiny_hidream
    from diffpipe_hunyuan.testing import original_path as hunyuan_file
    from diffpipe_hunyuan.testing import write_tiny_hunyuan
    from diffpipe_hunyuan.testing21 import original_path as hunyuan_image_file
    from diffpipe_hunyuan.testing21 import write_tiny_hunyuan_image
    from diffpipe_ltx.testing import single_file_path as ltx_file
    from diffpipe_ltx.testing import write_tiny_ltx
    from diffpipe_lumina.testing import original_path as lumina_file
    from diffpipe_lumina.testing import write_tiny_lumina2
    from diffpipe_omnigen.testing import comfy_path as omnigen_file
    from diffpipe_omnigen.testing import write_tiny_omnigen2
    from diffpipe_qwenimage.testing import comfy_path, write_tiny_qwen
    from diffpipe_sd3.testing import original_path as sd3_file
    from diffpipe_sd3.testing import write_tiny_sd3
    from diffpipe_sdxl.testing import write_single_file, write_tiny_sdxl
    from diffpipe_wan.testing import single_file_path as wan_file
    from diffpipe_wan.testing import write_tiny_wan

    sdxl = write_tiny_sdxl(root / "sdxl")
    flux = write_tiny_flux(root / "flux")
    qwen = write_tiny_qwen(root / "qwen")
    qwen_edit = write_tiny_qwen(root / "qwen-edit", "QwenImageEditPlusPipeline")
    return {
        "sdxl": (sdxl, write_single_file(sdxl, root / "sdxl.safetensors")),
        "flux": (flux, bfl_path(flux)),
        "flux-kontext": (flux, bfl_path(flux)),
        # and a Chroma folder where diffusion-pipe takes FLUX.1-dev's for Chroma's VAE and T5
        "chroma": (write_tiny_chroma(root / "chroma"), bfl_path(root / "chroma")),
        "ltx-video": (write_tiny_ltx(root / "ltx"), ltx_file(root / "ltx")),
        "hunyuan-video": (write_tiny_hunyuan(root / "hunyuan"), hunyuan_file(root / "hunyuan")),
        "hunyuan-image-2.1": (
            write_tiny_hunyuan_image(root / "hunyuan-image"), hunyuan_image_file(root / "hunyuan-image")
        ),
        "cosmos": (write_tiny_cosmos(root / "cosmos", TinyCosmosConfig(variant="1.0")), cosmos_file(root / "cosmos")),
        "cosmos-predict2": (write_tiny_cosmos(root / "predict2"), cosmos_file(root / "predict2")),
        "anima": (write_tiny_anima(root / "anima"), anima_file(root / "anima")),
        "wan": (write_tiny_wan(root / "wan"), wan_file(root / "wan")),
        "qwen-image": (qwen, comfy_path(qwen)),
        # diffpipe reads an edit model's diffusers folder (diffusion-pipe also takes Qwen-Image's with the edit file)
        "qwen-image-edit": (qwen_edit, comfy_path(qwen_edit)),
        "sd3": (write_tiny_sd3(root / "sd3"), sd3_file(root / "sd3")),
        "auraflow": (write_tiny_auraflow(root / "auraflow"), auraflow_file(root / "auraflow")),
        "lumina2": (write_tiny_lumina2(root / "lumina2"), lumina_file(root / "lumina2")),
        "hidream": (write_tiny_hidream(root / "hidream"), hidream_file(root / "hidream")),
        "omnigen2": (write_tiny_omnigen2(root / "omnigen2"), omnigen_file(root / "omnigen2")),
    }


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path | None]]:
    return _stand_ins(tmp_path_factory.mktemp("anchor_models"))


FILE_KEYS = ("transformer_path", "single_file_path", "checkpoint_path")


@pytest.mark.parametrize("index", [i for i, (_, body) in enumerate(SNIPPETS)
                                   if not COMPONENT_KEYS & set(tomllib.loads(body)["model"])
                                   and tomllib.loads(body)["model"]["type"] in MODEL_TYPES],
                         ids=lambda i: SNIPPET_IDS[i])
def test_every_model_snippet_validates_with_tiny_models_for_its_files(
    tmp_path: Path, index: int, stand_ins: dict[str, tuple[Path, Path | None]]
) -> None:
    heading, body = SNIPPETS[index]
    first = _convert(tmp_path, _in_main_example(body), EXAMPLES / "dataset.toml")
    name = tomllib.loads(first.files["run.toml"])["model"]["type"]
    folder, single = stand_ins[name]
    text = body
    paths = [(k, v) for k, v in tomllib.loads(body)["model"].items() if isinstance(v, str) and v.startswith("/")]
    for key, value in sorted(paths, key=lambda kv: -len(kv[1])):  # a folder's path may start a file's
        text = text.replace(value, str(single if key in FILE_KEYS else folder))
    write_image_dataset(tmp_path / "images", 2, size=(64, 64))
    edit = name in EDIT_VARIANTS.values()
    if edit:
        write_image_dataset(tmp_path / "controls", 2, size=(64, 64))
    dataset = tmp_path / "dp_dataset.toml"
    dataset.write_text("resolutions = [64]\n[[directory]]\npath = 'images'\n"
                       + ("control_path = 'controls'\n" * edit))
    imported = _convert(tmp_path, _in_main_example(text), dataset)
    run_text = re.sub(r"# TODO: (path|config_path) = \.\.\.", rf"\1 = '{folder}'  #", imported.files["run.toml"])
    result = _validate(tmp_path, run_text, imported.files["dataset.toml"])
    assert result.exit_code == 0, f"{heading}:\n{run_text}\n{result.output}"
    assert f"ok (model {name}" in result.output


def test_the_minimax_example_validates_with_its_comfyui_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40: diffusion-pipe's examples/minimax_h3_example.toml as written, tiny files under its own file names in
    place of its paths: the pruned (curve-form) int8 "convrot" fl2va transformer (trained text-to-video-and-audio, as
    the anchor trains it), ComfyUI's video and audio VAE files and the int8 "convrot" Qwen3-VL file; the configs and
    tokenizer in the Hugging Face cache. It imports with no TODO left and passes ``diffpipe validate``, which reads
    each file as what it is."""
    from diffpipe_core.testing.component_files import hub_snapshot, quantize_file
    from diffpipe_minimax.testing import comfyui_files, pruned_file, write_tiny_minimax

    example = (EXAMPLES / "minimax_h3_example.toml").read_text()
    given = tomllib.loads(example)["model"]
    where = Path(given["diffusion_model"]).parent
    comfy = tmp_path / "comfyui-models"
    folder = write_tiny_minimax(tmp_path / "models" / "minimax-h3")
    files = comfyui_files(folder, tmp_path / "plain")
    dit = pruned_file(folder, comfy / Path(given["diffusion_model"]).name, form="int8_convrot")
    vae, audio_vae = (files[k].rename(comfy / Path(given[k]).name) for k in ("vae", "audio_vae"))
    text = quantize_file(files["text_encoder"], comfy / Path(given["text_encoders"][0]["path"]).name, "int8_convrot")
    write_image_dataset(tmp_path / "images", 8, size=(64, 64))  # the example's image_micro_batch_size_per_gpu
    dataset = tmp_path / "dp_dataset.toml"
    dataset.write_text("resolutions = [64]\n[[directory]]\npath = 'images'\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_snapshot(folder, tmp_path / "hub", "MiniMaxAI/MiniMax-H3")
    imported = _convert(tmp_path, example.replace(str(where), str(comfy)), dataset)
    run_text = imported.files["run.toml"]
    assert "TODO" not in run_text.split("[model]")[1].split("\n[")[0], run_text
    result = _validate(tmp_path, run_text, imported.files["dataset.toml"])
    assert result.exit_code == 0, f"{run_text}\n{result.output}"
    assert "ok (model minimax-h3" in result.output and "the Hugging Face cache" in result.output
    assert f"diffusion_model: {dit}: original MiniMax H3 layout, quantized scaled (int8" in result.output
    assert "adaln_curve_grid = 1025 from the file's tensors" in result.output
    for path in (vae, audio_vae, text):
        assert f": {path}: " in result.output, path


def test_the_keys_diffpipe_has_now_are_carried(tmp_path: Path) -> None:
    """The keys issue 43 found dropped: LoKr's decompose_factor, W&B's [monitoring], float8_e5m2, and the dataset's
    size_buckets, subsample_ratio, default_mask_file and control_path; a Wan checkpoint's i2v model_type."""
    run_text = _in_main_example("[model]\ntype = 'cosmos_predict2'\ntransformer_path = '/m/model.safetensors'\n"
                                "dtype = 'bfloat16'\ntransformer_dtype = 'float8_e5m2'\n")
    run_text = run_text.replace("[adapter]\ntype = 'lora'\nrank = 32", "[adapter]\ntype = 'lokr'\nrank = 32\n"
                                "decompose_factor = 4")
    run_text = run_text.replace("enable_wandb = false\nwandb_api_key = ''\nwandb_tracker_name = ''\n"
                                "wandb_run_name = ''", "enable_wandb = true\nwandb_api_key = 'sekrit'\n"
                                "wandb_tracker_name = 'my-loras'\nwandb_run_name = 'first'")
    (tmp_path / "dataset.toml").write_text(
        "size_buckets = [[960, 960, 1], [1280, 704, 1]]\nsubsample_ratio = 0.5\nshuffle_metadata = true\n"
        "[[directory]]\npath = 'data'\ndefault_mask_file = 'mask.png'\ncontrol_path = 'control'\n"
    )
    imported = _convert(tmp_path, run_text, tmp_path / "dataset.toml")
    run, data = (tomllib.loads(imported.files[f]) for f in ("run.toml", "dataset.toml"))
    assert run["adapter"]["type"] == "lokr" and run["adapter"]["factor"] == 4
    assert run["logging"] == {"wandb": {"project": "my-loras", "name": "first"}}
    assert "sekrit" not in imported.files["run.toml"] and "wandb login" in imported.files["run.toml"]
    assert run["model"]["type"] == "cosmos-predict2" and run["model"]["quantize"] == "float8_e5m2"
    assert data["size_buckets"] == [[960, 960, 1], [1280, 704, 1]] and data["subsample_ratio"] == 0.5
    assert data["directory"] == [{"path": str(tmp_path / "data"), "default_mask_file": str(tmp_path / "mask.png"),
                                  "control_path": str(tmp_path / "control")}]
    assert "not carried: shuffle_metadata = true (diffpipe's data order does not depend on the file order" in \
        imported.files["dataset.toml"]

    wan = tmp_path / "Wan2.1-I2V-14B-480P"  # the official checkpoint folder: its config.json names the variant
    wan.mkdir()
    (wan / "config.json").write_text(json.dumps({"model_type": "i2v", "dim": 5120}))
    imported = _convert(tmp_path, _in_main_example(f"[model]\ntype = 'wan'\nckpt_path = '{wan}'\n"),
                        tmp_path / "dataset.toml")
    assert tomllib.loads(imported.files["run.toml"])["model"]["type"] == "wan-i2v"
    assert "config.json says model_type = 'i2v'" in imported.files["run.toml"]
    (wan / "config.json").write_text(json.dumps({"model_type": "flf2v", "dim": 5120}))  # first-last frame
    imported = _convert(tmp_path, _in_main_example(f"[model]\ntype = 'wan'\nckpt_path = '{wan}'\n"),
                        tmp_path / "dataset.toml")
    assert tomllib.loads(imported.files["run.toml"])["model"]["type"] == "wan-flf2v"


def test_max_sequence_length_becomes_text_max_length(tmp_path: Path) -> None:
    """Issue 38: diffusion-pipe's AuraFlow example sets ``max_sequence_length = 768`` (Pony V7): diffpipe's
    ``text_max_length``, not a key left behind."""
    body = next(body for heading, body in SNIPPETS if heading.strip() == "AuraFlow")
    imported = _convert(tmp_path, _in_main_example(body), EXAMPLES / "dataset.toml")
    run = tomllib.loads(imported.files["run.toml"])
    assert run["model"]["type"] == "auraflow" and run["model"]["text_max_length"] == 768


def test_model_files_land_on_diffpipes_component_keys(tmp_path: Path) -> None:
    """Issue 35: diffusion-pipe's model-file keys become diffpipe's component-file keys; text encoder files of
    several keys one ``text_encoders`` list; folders (an LLM's transformers folder) are read through path; without
    path the configs come from the Hugging Face cache, which the config says."""
    llm_folder = tmp_path / "llava-llama-3-8b-text-encoder-tokenizer"
    llm_folder.mkdir()
    model = (
        "[model]\ntype = 'flux'\ntransformer_path = '/m/flux1-dev-fp8_scaled.safetensors'\n"
        "vae_path = '/m/ae.safetensors'\nt5_path = '/m/t5xxl_fp16.safetensors'\nclip_path = '/m/clip_l.safetensors'\n"
        f"llm_path = '{llm_folder}'\ndtype = 'bfloat16'\n"
    )
    imported = _convert(tmp_path, _in_main_example(model), EXAMPLES / "dataset.toml")
    run = tomllib.loads(imported.files["run.toml"])["model"]
    assert run["diffusion_model"] == "/m/flux1-dev-fp8_scaled.safetensors" and run["vae"] == "/m/ae.safetensors"
    assert run["text_encoders"] == ["/m/clip_l.safetensors", "/m/t5xxl_fp16.safetensors"]
    text = imported.files["run.toml"]
    assert "(as a key: its file is in text_encoders, written at clip_path)" in text
    assert f"not carried: llm_path = '{llm_folder}'" in text and "path" not in run
    assert "TODO: path = ... (The model's diffusers folder" in text  # no snapshot in this machine's cache


# the snippets that give their model as ComfyUI component files, for a model diffpipe has (LTX-2's checkpoint holds
# its VAEs too: the test after the next)
COMPONENT_SNIPPETS = [
    i for i, (_, body) in enumerate(SNIPPETS)
    if COMPONENT_KEYS & set(tomllib.loads(body)["model"]) and tomllib.loads(body)["model"]["type"] in MODEL_TYPES
    and tomllib.loads(body)["model"]["type"] != "ltx2"
]  # fmt: skip
LTX2_SNIPPETS = [i for i, (_, body) in enumerate(SNIPPETS) if tomllib.loads(body)["model"]["type"] == "ltx2"]


def _tiny_folder(name: str, root: Path) -> Path:
    """A tiny diffusers folder of model type ``name`` (the component snippets' models)."""
    from diffpipe_ernie.testing import write_tiny_ernie
    from diffpipe_flux.testing import write_tiny_flux2, write_tiny_klein
    from diffpipe_hunyuan.testing15 import write_tiny_hunyuan15
    from diffpipe_ideogram.testing import write_tiny_ideogram4
    from diffpipe_krea.testing import write_tiny_krea2
    from diffpipe_minimax.testing import write_tiny_minimax
    from diffpipe_zimage.testing import write_tiny_zimage

    writers = {
        "z-image": write_tiny_zimage, "hunyuan-video-1.5": write_tiny_hunyuan15, "flux2": write_tiny_flux2,
        "flux2-klein": write_tiny_klein, "krea2": write_tiny_krea2,
        "ideogram4": write_tiny_ideogram4, "ernie-image": write_tiny_ernie, "minimax-h3": write_tiny_minimax,
    }  # fmt: skip
    return writers[name](root / name)


@pytest.mark.parametrize("index", COMPONENT_SNIPPETS, ids=lambda i: SNIPPET_IDS[i])
def test_every_component_file_snippet_validates_with_tiny_component_files(
    tmp_path: Path, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35 with 43: a snippet that gives its model as ComfyUI files (no diffusers folder) converts to diffpipe's
    component keys and, with tiny component files in place of its paths and the model's configs in the Hugging Face
    cache (as a user who downloaded them once has them), passes ``diffpipe validate`` with no TODO left."""
    from diffpipe_core.anchor.keys import toml_key, toml_value
    from diffpipe_core.testing.component_files import hub_snapshot, write_component_files

    heading, body = SNIPPETS[index]
    model = tomllib.loads(body)["model"]
    name = tomllib.loads(_convert(tmp_path, _in_main_example(body), EXAMPLES / "dataset.toml").files["run.toml"])[
        "model"]["type"]  # fmt: skip
    folder = _tiny_folder(name, tmp_path / "models")
    files = write_component_files(folder, tmp_path / "comfy")  # diffusers' names: read under any layout
    # under the snippet's own file name: the importer tells variants apart by it (FLUX.2 [klein] from [dev])
    dit = files["diffusion_model"].rename(files["diffusion_model"].with_name(Path(model["diffusion_model"]).name))
    files["diffusion_model"] = dit
    given = {"diffusion_model": str(dit), "vae": str(files["vae"])}
    given["text_encoders"] = [str(p) for p in files["text_encoders"]]
    model = {k: v for k, v in model.items() if k not in (*COMPONENT_KEYS, "merge_adapters")}
    model.update({k: v for k, v in given.items() if k != "vae" or "vae" in tomllib.loads(body)["model"]})
    table = "[model]\n" + "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in model.items())
    write_image_dataset(tmp_path / "images", 2, size=(64, 64))
    dataset = tmp_path / "dp_dataset.toml"
    dataset.write_text("resolutions = [64]\n[[directory]]\npath = 'images'\n")
    schema = get_registry().model(name).spec.config_schema
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_snapshot(folder, tmp_path / "hub", schema.hub_repos[0])
    imported = _convert(tmp_path, _in_main_example(table), dataset)
    run_text = imported.files["run.toml"]
    assert "TODO" not in run_text.split("[model]")[1].split("\n[")[0], run_text
    assert "the Hugging Face cache's snapshot of the model" in run_text
    result = _validate(tmp_path, run_text, imported.files["dataset.toml"])
    assert result.exit_code == 0, f"{heading}:\n{run_text}\n{result.output}"
    assert f"ok (model {name}" in result.output and "the Hugging Face cache" in result.output
    assert f"diffusion_model: {files['diffusion_model']}: diffusers" in result.output
    for path in [*files["text_encoders"], *([files["vae"]] if "vae" in model else [])]:  # each file read as given
        assert f": {path}: diffusers" in result.output, path


@pytest.mark.parametrize("index", LTX2_SNIPPETS, ids=lambda i: SNIPPET_IDS[i])
def test_the_ltx23_snippet_imports_as_ltx23_and_validates_with_a_tiny_comfy_checkpoint(
    tmp_path: Path, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: diffusion-pipe's ``type = 'ltx2'`` trains LTX-2.3 from ComfyUI's checkpoint (transformer, text
    connectors, VAE and audio VAE in one file, its VAE read from it) and a Gemma 3 file: it imports as ``ltx-2.3``
    with ``vae`` and ``audio_vae`` naming the checkpoint, every key carried or named, and with a tiny LTX-2.3's files
    in place of its paths (its configs in the Hugging Face cache) passes ``diffpipe validate``."""
    from diffpipe_core.anchor.keys import toml_key, toml_value
    from diffpipe_core.testing.component_files import hub_snapshot
    from diffpipe_ltx.ltx2_testing import write_comfy_files, write_tiny_ltx23

    heading, body = SNIPPETS[index]
    model = tomllib.loads(body)["model"]
    folder = write_tiny_ltx23(tmp_path / "models" / "ltx-2.3")
    files = write_comfy_files(folder, tmp_path / "comfy", Path(model["diffusion_model"]).name)
    model.update(diffusion_model=str(files["checkpoint"]), text_encoder=str(files["gemma"]))
    table = "[model]\n" + "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in model.items())
    write_image_dataset(tmp_path / "images", 2, size=(64, 64))
    dataset = tmp_path / "dp_dataset.toml"
    dataset.write_text("resolutions = [64]\n[[directory]]\npath = 'images'\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_snapshot(folder, tmp_path / "hub", "Lightricks/LTX-2.3")
    imported = _convert(tmp_path, _in_main_example(table), dataset)
    run_text = imported.files["run.toml"]
    run = tomllib.loads(run_text)["model"]
    checkpoint = str(files["checkpoint"])
    assert run["type"] == "ltx-2.3", run_text
    assert run["diffusion_model"] == run["vae"] == run["audio_vae"] == checkpoint
    assert run["text_encoders"] == [str(files["gemma"])] and run["quantize"] == "float8"
    assert "TODO" not in run_text.split("[model]")[1].split("\n[")[0], run_text
    named = _not_carried(run_text, "run")
    for key in model:  # every key of the snippet carried or named
        assert key in run or ("model", key) in named or f"# was {key} = " in run_text, (key, run_text)
    result = _validate(tmp_path, run_text, imported.files["dataset.toml"])
    assert result.exit_code == 0, f"{heading}:\n{run_text}\n{result.output}"
    assert "ok (model ltx-2.3" in result.output
    for component in ("diffusion_model", "vae", "audio_vae"):
        assert f"{component}: {checkpoint}: original Lightricks layout" in result.output, component


@pytest.mark.parametrize(("keys", "name", "expected"), [
    (("prompt_adaln_single.linear.weight", "audio_prompt_adaln_single.linear.weight"), "x.safetensors", "ltx-2.3"),
    (("prompt_adaln.linear.weight",), "x.safetensors", "ltx-2.3"),  # diffusers' name
    (("transformer_blocks.0.prompt_scale_shift_table",), "ltx-2.3-x.safetensors", "ltx-2.5"),
    (("transformer_blocks.0.attn1.to_q.weight",), "ltx-2.3-x.safetensors", "ltx-2"),
    (None, "ltx-2-19b-dev.safetensors", "ltx-2"),
    (None, "ltx-2.5-dev.safetensors", "ltx-2.5"),
    (None, "ltx-2.3-22b-dev.safetensors", "ltx-2.3"),
])  # fmt: skip
def test_the_ltx2_checkpoint_tells_which_ltx2_diffusion_pipe_was_given(
    tmp_path: Path, keys: tuple[str, ...] | None, name: str, expected: str
) -> None:
    """diffusion-pipe names LTX-2.3 only; the checkpoint's keys (its name, where it is not here) say 2.0 or 2.5."""
    import torch
    from safetensors.torch import save_file

    from diffpipe_core.anchor.models import diffpipe_model

    if keys is not None:
        block = "model.diffusion_model.transformer_blocks.0.attn1.to_k.weight"
        save_file({block: torch.zeros(1), **{f"model.diffusion_model.{k}": torch.zeros(1) for k in keys}},
                  str(tmp_path / name))
    choice = diffpipe_model("ltx2", {"diffusion_model": name}, False, tmp_path)
    assert choice.name == expected and (expected == "ltx-2.3") == (choice.why == "")
