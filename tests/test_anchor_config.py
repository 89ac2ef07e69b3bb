"""A tdrussell/diffusion-pipe config runs, or says exactly what to change (issue 26).

``diffpipe import-config`` on the anchor's own examples (their settings, at tdrussell/diffusion-pipe 8f83dbf:
``examples/main_example.toml`` and ``examples/dataset.toml``, written into the test's tmp dir) gives files that
``diffpipe validate`` accepts once the one value it cannot know is filled in; and ``validate`` on an anchor key
names the diffpipe key instead of guessing a spelling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

from diffpipe_core.anchor.keys import Context, changes_for
from diffpipe_core.cli import main
from diffpipe_core.config import AdapterConfig, load_config
from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset

# The settings of diffusion-pipe's examples/main_example.toml (its comments left out), in its order.
ANCHOR_MAIN = """\
output_dir = '/data/diffusion_pipe_training_runs/hunyuan_video_test'
dataset = 'examples/dataset.toml'
epochs = 1000
micro_batch_size_per_gpu = 1
pipeline_stages = 1
gradient_accumulation_steps = 1
gradient_clipping = 1.0
warmup_steps = 100
eval_every_n_epochs = 1
eval_before_first_step = true
eval_micro_batch_size_per_gpu = 1
eval_gradient_accumulation_steps = 1
save_every_n_epochs = 2
checkpoint_every_n_minutes = 120
activation_checkpointing = true
partition_method = 'parameters'
save_dtype = 'bfloat16'
caching_batch_size = 1
steps_per_print = 1
video_clip_mode = 'single_beginning'

[model]
type = 'hunyuan-video'
transformer_path = '/data2/imagegen_models/hunyuan_video_comfyui/hunyuan_video_720_cfgdistill_fp8_e4m3fn.safetensors'
vae_path = '/data2/imagegen_models/hunyuan_video_comfyui/hunyuan_video_vae_bf16.safetensors'
llm_path = '/data2/imagegen_models/hunyuan_video_comfyui/llava-llama-3-8b-text-encoder-tokenizer'
clip_path = '/data2/imagegen_models/hunyuan_video_comfyui/clip-vit-large-patch14'
dtype = 'bfloat16'
transformer_dtype = 'float8'
timestep_sample_method = 'logit_normal'

[adapter]
type = 'lora'
rank = 32
dtype = 'bfloat16'

[optimizer]
type = 'adamw_optimi'
lr = 2e-5
betas = [0.9, 0.99]
weight_decay = 0.01
eps = 1e-8

[monitoring]
enable_wandb = false
wandb_api_key = ''
wandb_tracker_name = ''
wandb_run_name = ''
"""

# The settings of diffusion-pipe's examples/dataset.toml.
ANCHOR_DATASET = """\
resolutions = [512]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 7
frame_buckets = [1, 33]

[[directory]]
path = '/home/anon/data/images/grayscale'
num_repeats = 1
"""

# The options its comments offer (and the dataset keys they mention), switched on.
ANCHOR_OPTIONS = {
    "micro_batch_size_per_gpu = 1": "micro_batch_size_per_gpu = [[512, 4], [1024, 1]]\n"
    "image_micro_batch_size_per_gpu = 4\nmax_steps = 5000\nforce_constant_lr = 1e-5\nlr_scheduler = 'linear'\n"
    "blocks_to_swap = 20\npseudo_huber_c = 0.5\neval_every_n_examples = 1000\nsave_every_n_examples = 1000\n"
    "checkpoint_every_n_epochs = 1\npartition_split = [10]\n"
    "map_num_proc = 32\ncompile = true\nx_axis_examples = true",
    "activation_checkpointing = true": "activation_checkpointing = 'unsloth'\n"
    "reentrant_activation_checkpointing = true",
    "partition_method = 'parameters'": "partition_method = 'manual'",
    "pipeline_stages = 1": "pipeline_stages = 2",
    "enable_wandb = false\nwandb_api_key = ''": "enable_wandb = true\nwandb_api_key = 'sekrit-api-key'",
    "[optimizer]\ntype = 'adamw_optimi'": "[optimizer]\ntype = 'AdamW8bitKahan'\nstabilize = false",
}
DATASET_OPTIONS = {
    "frame_buckets = [1, 33]": "frame_buckets = [1, 33]\ncache_shuffle_num = 10\ncache_shuffle_delimiter = ';'\n"
    "skip_empty_caption = false\nnum_repeats = 3",
    "num_repeats = 1": "ar_buckets = [[448, 576]]\nresolutions = [[448, 576]]",
}


@pytest.fixture(scope="module")
def hunyuan_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HunyuanVideo diffusers folder, its transformer as one original-layout file, and 4 images."""
    from diffpipe_hunyuan.testing import original_path, write_tiny_hunyuan

    root = tmp_path_factory.mktemp("hunyuan_files")
    write_tiny_hunyuan(root / "hunyuan")
    assert original_path(root / "hunyuan").is_file()
    write_image_dataset(root / "images", 4, size=(64, 64))
    return root


def _anchor_project(tmp: Path, files: Path, main: str = ANCHOR_MAIN, dataset: str = ANCHOR_DATASET) -> Path:
    """diffusion-pipe's checkout as a user has it: the examples in examples/, paths pointing at this machine's
    files. Returns the checkout (where diffusion-pipe runs, so where its relative paths start)."""
    from diffpipe_hunyuan.testing import original_path

    checkout = tmp / "diffusion-pipe"
    (checkout / "examples").mkdir(parents=True)
    main = main.replace("/data/diffusion_pipe_training_runs/hunyuan_video_test", str(tmp / "runs"))
    main = main.replace(
        "/data2/imagegen_models/hunyuan_video_comfyui/hunyuan_video_720_cfgdistill_fp8_e4m3fn.safetensors",
        str(original_path(files / "hunyuan")),
    )
    (checkout / "examples" / "main_example.toml").write_text(main)
    dataset = dataset.replace("/home/anon/data/images/grayscale", str(files / "images"))
    (checkout / "examples" / "dataset.toml").write_text(dataset)
    return checkout


def _import(checkout: Path, out: Path) -> str:
    result = CliRunner().invoke(
        main, ["import-config", str(checkout / "examples" / "main_example.toml"), "--anchor-dir", str(checkout),
               "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return result.output


def _validate(run_toml: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["validate", "--config", str(run_toml)])
    return result.exit_code, result.output


def _keys(text: str) -> dict[str, object]:
    return tomllib.loads(text)


def _comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))


def test_the_anchors_main_example_imports_and_validates(tmp_path: Path, hunyuan_files: Path) -> None:
    checkout = _anchor_project(tmp_path, hunyuan_files)
    out = tmp_path / "converted"
    output = _import(checkout, out)
    run_text, data_text = (out / "run.toml").read_text(), (out / "dataset.toml").read_text()
    run, data = _keys(run_text), _keys(data_text)
    assert run["dataset"] == "dataset.toml" and run["output_dir"] == str(tmp_path / "runs")
    assert run["model"]["quantize"] == "float8" and "transformer_dtype" not in run["model"]
    assert run["model"]["diffusion_model"].endswith(".original.safetensors")
    assert run["optimizer"]["type"] == "adamw_optimi"
    assert run["adapter"] == {"type": "lora", "rank": 32, "dtype": "bfloat16"}
    assert run["eval_before_first_step"] is True and "video_clip_mode" not in run
    assert data["video_clip_mode"] == "single_beginning"
    assert data["directory"] == [{"path": str(hunyuan_files / "images"), "num_repeats": 1}]
    # every anchor key is either in the output as it was, or named in a comment saying what became of it
    examples = checkout / "examples"
    anchor, anchor_data = (tomllib.loads((examples / f).read_text()) for f in ("main_example.toml", "dataset.toml"))
    comments = _comments(run_text) + "\n" + _comments(data_text)
    for table, keys in [("", anchor), *((t, anchor[t]) for t in ("model", "adapter", "optimizer"))]:
        written = run.get(table, {}) if table else run
        for key, value in keys.items():
            if key in ("model", "adapter", "optimizer") and not table:
                continue
            if isinstance(value, dict):
                assert f"[{key}]" in comments, key
            elif written.get(key) != value:
                assert f"{key} = " in comments, f"{table}.{key} changed without a comment"
    for key, value in anchor_data.items():
        if key != "directory" and data.get(key) != value:
            assert f"{key} = " in comments, key
    assert "not carried: steps_per_print = 1 (it is DeepSpeed's console log interval" in comments
    assert "moved here: diffusion-pipe had video_clip_mode = 'single_beginning' in its run config" in comments
    assert "was transformer_dtype = 'float8'" in comments and "not carried: [monitoring]" in comments
    # the one thing it cannot know: a diffusers folder for the VAE and text encoders diffusion-pipe took from files
    assert "1 to fill in before training" in output and "model.path: The model's diffusers folder" in output
    code, text = _validate(out / "run.toml")
    assert code == 1 and "model.path: required: not given" in text and text.count("problem") <= 1
    run_toml = out / "run.toml"
    # the VAE file diffusion-pipe's example names (ComfyUI's) is carried as [model] vae; it is not on this machine
    vae = "vae = '/data2/imagegen_models/hunyuan_video_comfyui/hunyuan_video_vae_bf16.safetensors'\n"
    assert vae in run_text
    run_text = run_text.replace(vae, "")
    run_toml.write_text(run_text.replace("# TODO: path = ...", f"path = '{hunyuan_files / 'hunyuan'}'  #"))
    code, text = _validate(run_toml)
    assert code == 0, text
    assert "ok (model hunyuan-video" in text
    # never over the user's files: a second import into the same folder stops, naming the file
    result = CliRunner().invoke(main, ["import-config", str(checkout / "examples" / "main_example.toml"),
                                       "--anchor-dir", str(checkout), "--out", str(out)])
    assert result.exit_code == 1 and "already exists" in result.output and "--force" in result.output


def test_the_options_of_the_anchors_example_import(tmp_path: Path, hunyuan_files: Path) -> None:
    """The choices main_example.toml and dataset.toml describe in comments: each lands on its diffpipe key."""
    main_text, data_text = ANCHOR_MAIN, ANCHOR_DATASET
    for old, new in ANCHOR_OPTIONS.items():
        assert old in main_text
        main_text = main_text.replace(old, new, 1)
    for old, new in DATASET_OPTIONS.items():
        assert old in data_text
        data_text = data_text.replace(old, new, 1)
    checkout = _anchor_project(tmp_path, hunyuan_files, main_text, data_text)
    _import(checkout, tmp_path / "out")
    run_text = (tmp_path / "out" / "run.toml").read_text()
    data_out = (tmp_path / "out" / "dataset.toml").read_text()
    run, data = _keys(run_text), _keys(data_out)
    assert run["micro_batch_size_per_gpu"] == [[512, 4], [1024, 1]] and run["image_micro_batch_size_per_gpu"] == 4
    assert run["activation_checkpointing"] == "offload" and run["checkpoint_every_n_epochs"] == 1
    assert run["pseudo_huber_c"] == 0.5 and run["compile"] is True and run["partition_split"] == [10]
    assert run["eval_every_n_steps"] == 1000 // 4 and run["save_every_n_steps"] == 1000 // 4  # 4 samples a step
    assert "partition_method" not in run and run["optimizer"]["type"] == "adamw8bit_kahan"
    comments = _comments(run_text)
    assert run["optimizer"]["force_constant_lr"] == 1e-5
    for dropped in ("reentrant_activation_checkpointing", "map_num_proc", "x_axis_examples",
                    "stabilize", "partition_method = 'manual'"):
        assert f"not carried: {dropped}" in comments, dropped
    assert "sekrit" not in run_text  # an API key never goes into a comment
    assert data["shuffle_tags"] is True and data["cache_shuffle_num"] == 10 and data["tag_delimiter"] == ";"
    assert data["allow_empty_captions"] is True and "skip_empty_caption" not in data
    # the top-level num_repeats is a per-directory key in diffpipe: the directory without its own gets it
    assert data["directory"] == [
        {"path": str(hunyuan_files / "images"), "ar_buckets": [[448, 576]], "resolutions": [[448, 576]],
         "num_repeats": 3}
    ]
    run_toml = tmp_path / "out" / "run.toml"
    # the VAE file diffusion-pipe's example names (ComfyUI's) is carried as [model] vae; it is not on this machine
    vae = "vae = '/data2/imagegen_models/hunyuan_video_comfyui/hunyuan_video_vae_bf16.safetensors'\n"
    assert vae in run_text
    run_text = run_text.replace(vae, "")
    run_toml.write_text(run_text.replace("# TODO: path = ...", f"path = '{hunyuan_files / 'hunyuan'}'  #"))
    cfg_problems = []
    try:
        load_config(run_toml, get_registry())
    except ConfigError as exc:
        cfg_problems = exc.problems
    # hunyuan-video's compute_loss (the shared parts') takes the run's loss settings: pseudo_huber_c applies, and
    # nothing else is wrong
    assert cfg_problems == [], cfg_problems
    load_dataset_config(tmp_path / "out" / "dataset.toml")


def test_an_adapter_or_optimizer_diffpipe_lacks_is_a_todo_not_a_silent_swap() -> None:
    ctx = Context()
    known = AdapterConfig.model_fields["type"].annotation.__args__
    (lokr,) = changes_for("adapter", "type", "lokr", ctx)
    assert lokr.value == "lokr" and lokr.needs_input == ("lokr" not in known)
    (automagic,) = changes_for("optimizer", "type", "automagic", ctx)
    assert automagic.value == "automagic" and not automagic.needs_input  # the diffpipe-optimizers plugin's
    (came,) = changes_for("optimizer", "type", "CAME", ctx)  # the anchor's fallback: pytorch-optimizer by class name
    assert came.value == "pytorch_optimizer.CAME" and not came.needs_input and "pytorch-optimizer" in came.why
    (optimi,) = changes_for("optimizer", "type", "adamw_optimi", ctx)
    assert optimi.value == "adamw_optimi" and not optimi.needs_input


# ---------------------------------------------------------------------------------------- validate's hints
RUN = """
output_dir = "out"
dataset = "dataset.toml"
{top}
[model]
type = "reference"
path = "model"
{model}
[adapter]
rank = 4
{tables}
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    from diffpipe_reference.model import write_tiny_model

    write_tiny_model(tmp_path / "model")
    write_image_dataset(tmp_path / "images", 1, size=(32, 32))
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "images", resolutions=[32])
    return tmp_path


def run_problems(project: Path, top: str = "", model: str = "", tables: str = "") -> list[str]:
    (project / "run.toml").write_text(RUN.format(top=top, model=model, tables=tables))
    with pytest.raises(ConfigError) as err:
        load_config(project / "run.toml", get_registry())
    return err.value.problems


def dataset_problems(project: Path, top: str = "", directory: str = "") -> list[str]:
    path = project / "anchor_dataset.toml"
    path.write_text(f'{top}\n[[directory]]\npath = "images"\n{directory}\n')
    with pytest.raises(ConfigError) as err:
        load_dataset_config(path)
    return err.value.problems


def test_transformer_dtype_float8_names_quantize(project: Path) -> None:
    (problem,) = run_problems(project, model="transformer_dtype = 'float8'")
    assert "model.transformer_dtype: diffusion-pipe's key; write model.quantize = 'float8' instead" in problem
    assert "diffusion_model" not in problem and "Did you mean" not in problem


def test_skip_empty_caption_names_its_inverse(project: Path) -> None:
    (problem,) = dataset_problems(project, top="skip_empty_caption = false")
    assert "skip_empty_caption = false; write allow_empty_captions = true instead" in problem
    (problem,) = dataset_problems(project, directory="skip_empty_caption = true")
    assert "directory[0].skip_empty_caption" in problem and "allow_empty_captions" in problem
    assert "Remove it" in problem and "write allow_empty_captions = true" not in problem


def test_cache_shuffle_delimiter_names_tag_delimiter(project: Path) -> None:
    (problem,) = dataset_problems(project, top="cache_shuffle_delimiter = ';'")
    assert "write tag_delimiter = ';' instead" in problem and "cache_shuffle_num" not in problem


def test_eval_before_first_step_is_a_key_now(project: Path) -> None:
    (project / "run.toml").write_text(RUN.format(top="eval_before_first_step = true", model="", tables=""))
    assert load_config(project / "run.toml", get_registry()).run.eval_before_first_step is True


def test_diffusers_path_steps_per_print_video_clip_mode_and_monitoring(project: Path) -> None:
    problems = run_problems(
        project,
        top="steps_per_print = 1\nvideo_clip_mode = 'single_middle'",
        model="diffusers_path = 'model'",
        tables="[monitoring]\nenable_wandb = true\nwandb_api_key = 'sekrit'\n",
    )
    text = "\n".join(problems)
    assert "model.diffusers_path: diffusion-pipe's key; write model.path = 'model' instead" in text
    assert "steps_per_print: diffusion-pipe's key with no diffpipe equivalent: it is DeepSpeed's console" in text
    assert "video_clip_mode: diffusion-pipe's key; diffpipe reads it from the dataset TOML: write " \
           "video_clip_mode = 'single_middle' there" in text
    assert "monitoring: diffusion-pipe's key; write logging.wandb = <your choice> instead" in text
    assert "give the W&B project" in text and "sekrit" not in text
    assert "Valid keys here" not in text and "Did you mean" not in text


def test_activation_checkpointing_unsloth_is_one_line_naming_offload(project: Path) -> None:
    (problem,) = run_problems(project, top="activation_checkpointing = 'unsloth'")
    assert "activation_checkpointing: invalid value 'unsloth': expected true or false or 'offload'" in problem
    assert "write activation_checkpointing = 'offload' instead" in problem
    for internal in ("activation_checkpointing.bool", "literal[", "Input should be"):
        assert internal not in problem


def test_the_valid_keys_are_listed_once_per_table(project: Path) -> None:
    top, model = "epochz = 1\nwarmup_stepz = 2\nseedd = 3", "shfit = 1.0\nsigmoid_scal = 2"
    problems = run_problems(project, top=top, model=model)
    assert len(problems) == 5
    assert sum("Valid keys here" in p for p in problems) == 2  # the top level's once, [model]'s once
    assert "Did you mean 'epochs'?" in problems[0] and "Valid keys here: activation_checkpointing" in problems[0]
    assert problems[1].endswith("(valid keys listed above)") and "Did you mean 'warmup_steps'?" in problems[1]


def test_the_manual_table_names_every_anchor_key_the_importer_knows() -> None:
    """docs/diffusion-pipe.md's key table is generated from RULES (python -m diffpipe_core.manual; test_manual.py
    keeps it fresh): every key has its row."""
    import re

    from diffpipe_core.anchor.keys import RULES

    page = (Path(__file__).resolve().parents[1] / "docs" / "diffusion-pipe.md").read_text()
    section = page.split("<!-- generated: anchor-keys", 1)[1].split("<!-- end generated: anchor-keys -->", 1)[0]
    rows = set(re.findall(r"^\| `([^`]*)` \(", section, re.M))
    missing = [f"{s}.{k}" for s, rules in RULES.items() for k in rules if k not in rows]
    assert not missing, f"the manual's diffusion-pipe table lacks {missing}"


def _imported_run(tmp_path: Path, model: str) -> dict:
    from diffpipe_core.anchor.convert import import_config

    (tmp_path / "anchor.toml").write_text(f"output_dir = 'runs'\n[model]\n{model}\n[optimizer]\ntype = 'adamw_optimi'\n"
                                          "lr = 2e-5\n")
    return _keys(import_config(tmp_path / "anchor.toml", tmp_path).files["run.toml"])


def test_sdxl_learning_rates_per_part_become_group_lr_with_the_text_encoders_trained(tmp_path: Path) -> None:
    """diffusion-pipe's SDXL example: unet_lr and text_encoder_*_lr, and its text encoders always trained."""
    run = _imported_run(tmp_path, "type = 'sdxl'\nunet_lr = 4e-5\ntext_encoder_1_lr = 2e-5\ntext_encoder_2_lr = 1e-5")
    assert run["optimizer"]["group_lr"] == {"unet": 4e-5, "text_encoder_1": 2e-5, "text_encoder_2": 1e-5}
    assert run["model"]["train_text_encoders"] is True
    run = _imported_run(tmp_path, "type = 'sdxl'")  # no rates: diffusion-pipe trains them at the optimizer's lr
    assert run["model"]["train_text_encoders"] is True and "group_lr" not in run["optimizer"]
    run = _imported_run(tmp_path, "type = 'flux'\nunet_lr = 4e-5")  # no such parts: not carried
    assert "group_lr" not in run["optimizer"] and "train_text_encoders" not in run["model"]


@pytest.mark.parametrize(("anchor", "ours"), [("qwen_image", "qwen-image"), ("z_image", "z-image"), ("wan", "wan")])
def test_the_anchors_model_types_name_diffpipes(tmp_path: Path, anchor: str, ours: str) -> None:
    assert _imported_run(tmp_path, f"type = '{anchor}'")["model"]["type"] == ours


def test_omnigen2_keeps_the_anchors_shift_where_diffpipes_default_differs(tmp_path: Path) -> None:
    """diffusion-pipe's OmniGen2 shifts by resolution only with flux_shift = true, and never when shift is set;
    diffpipe's default is on, so the importer writes the anchor's choice."""
    assert _imported_run(tmp_path, "type = 'omnigen2'")["model"]["flux_shift"] is False
    assert _imported_run(tmp_path, "type = 'omnigen2'\nflux_shift = true")["model"]["flux_shift"] is True
    run = _imported_run(tmp_path, "type = 'omnigen2'\nflux_shift = true\nshift = 3.0")
    assert run["model"]["flux_shift"] is False and run["model"]["shift"] == 3.0
    assert "flux_shift" not in _imported_run(tmp_path, "type = 'flux'")["model"]


def test_the_anchors_minimax_example_imports(tmp_path: Path) -> None:
    """diffusion-pipe's examples/minimax_h3_example.toml (at 8f83dbf, its ComfyUI files as it names them): type
    minimax_h3 is diffpipe's minimax-h3, its files are carried as the component-file keys, the anchor's defaults where
    diffpipe's differ (no shift, the clips' sound trained) are written, and image_shift is named. (That the result
    validates with tiny files in place of these, the pruned int8 "convrot" transformer and Qwen3-VL files included:
    tests/test_anchor_examples.py's test_the_minimax_example_validates_with_its_comfyui_files; that each file loads
    as its component: the plugin's test_minimax_component_files.py and test_minimax_pruned.py.)"""
    from diffpipe_core.anchor.convert import import_config

    anchor = Path(__file__).parent / "anchor_examples" / "minimax_h3_example.toml"
    (tmp_path / "dataset.toml").write_text("resolutions = [64]\n[[directory]]\npath = 'images'\n")
    run_text = import_config(anchor, tmp_path, tmp_path / "dataset.toml").files["run.toml"]
    model, given = _keys(run_text)["model"], tomllib.loads(anchor.read_text())["model"]
    assert model["type"] == "minimax-h3" and model["cfg"] == 4 and model["shift"] == 8
    assert model["train_audio"] is True and model["timestep_sample_method"] == "uniform"
    assert {k: model[k] for k in ("diffusion_model", "vae", "audio_vae", "text_encoders")} == {
        k: given[k] for k in ("diffusion_model", "vae", "audio_vae", "text_encoders")}
    assert "not carried: image_shift = 1 (diffpipe's 'minimax-h3' model shifts an image's training times" in run_text
    assert "TODO: path = ..." in run_text  # the configs folder: the one thing the anchor's config cannot say
    assert _imported_run(tmp_path, "type = 'minimax_h3'")["model"]["shift"] == 1.0  # the anchor's default: none
