"""Acceptance 4: config errors name the file, the key path, the bad value and what is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.config import check_world_size, load_config
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import run_diffpipe
from diffpipe_reference.model import write_tiny_model

GOOD = """
output_dir = "out"
dataset = "dataset.toml"
micro_batch_size_per_gpu = 1
pipeline_stages = 2

[model]
type = "reference"
path = "model"

[adapter]
rank = 4
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    write_tiny_model(tmp_path / "model")
    write_image_dataset(tmp_path / "images", 2)
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "images", resolutions=[64])
    return tmp_path


def problems_for(project: Path, text: str) -> list[str]:
    path = project / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, get_registry())
    return err.value.problems


def test_good_config_loads(project: Path) -> None:
    (project / "run.toml").write_text(GOOD)
    cfg = load_config(project / "run.toml", get_registry())
    assert cfg.run.pipeline_stages == 2 and cfg.model.path == project / "model"
    assert cfg.run.adapter.effective_alpha == 4.0
    assert cfg.run.output_dir == project / "out"


def test_unknown_key_suggests_the_close_spelling(project: Path) -> None:
    problems = problems_for(project, GOOD.replace("pipeline_stages", "pipeline_stage"))
    assert len(problems) == 1
    assert str(project / "run.toml") in problems[0]
    assert "pipeline_stage" in problems[0] and "Did you mean 'pipeline_stages'?" in problems[0]


def test_unknown_key_in_plugin_model_table(project: Path) -> None:
    problems = problems_for(project, GOOD.replace('path = "model"', 'path = "model"\nsigmoid_scal = 1.0'))
    assert any("model.sigmoid_scal" in p and "Did you mean 'sigmoid_scale'?" in p for p in problems)


def test_wrong_type_names_value_and_expected_type(project: Path) -> None:
    problems = problems_for(project, GOOD.replace("micro_batch_size_per_gpu = 1", 'micro_batch_size_per_gpu = "two"'))
    assert len(problems) == 1
    assert "micro_batch_size_per_gpu" in problems[0] and "'two'" in problems[0] and "an integer" in problems[0]


@pytest.mark.parametrize(
    ("key", "line", "said"),
    [
        ("adapter.alpha", "alpha = true", "invalid value true: true/false is not a number"),
        ("max_steps", "max_steps = true", "invalid value true: true/false is not a number"),
        ("max_steps", "max_steps = 4.0", "invalid value 4.0: a fraction, where an integer (or leave it out) is "
                                         "expected (write 4)"),
        ("optimizer.group_lr.model", "[optimizer]\ngroup_lr = { model = false }",
         "invalid value false: true/false is not a number"),
        ("model.sigmoid_scale", None, "invalid value true: true/false is not a number"),
    ],
)
def test_numbers_are_strict(project: Path, key: str, line: str | None, said: str) -> None:
    """A bool is never a number and a float never an integer, though pydantic's lax mode converts both."""
    if key == "model.sigmoid_scale":
        text = GOOD.replace('path = "model"', 'path = "model"\nsigmoid_scale = true')
    elif key.startswith("adapter."):
        text = GOOD.replace("rank = 4", f"rank = 4\n{line}")
    elif line.startswith("["):
        text = GOOD + line + "\n"
    else:
        text = line + "\n" + GOOD
    problems = problems_for(project, text)
    assert len(problems) == 1 and problems[0].startswith(f"{project / 'run.toml'}: {key}: {said}"), problems


def test_dataset_numbers_are_strict(project: Path) -> None:
    from diffpipe_core.data.dataset_config import load_dataset_config

    toml = project / "strict.toml"
    toml.write_text('resolutions = [64.0]\n[[directory]]\npath = "images"\nnum_repeats = true\n')
    with pytest.raises(ConfigError) as err:
        load_dataset_config(toml)
    text = "\n".join(err.value.problems)
    assert "resolutions[0]: invalid value 64.0: a fraction, where " in text, text
    assert "directory[0].num_repeats: invalid value true: true/false is not a number" in text, text


def test_every_plugin_model_table_takes_integers_strictly() -> None:
    """Each installed plugin's ``[model]`` integer keys refuse 32.0 and true, as pydantic's strict mode would."""
    import typing

    from diffpipe_core.schema import loose_numbers

    checked = 0
    registry = get_registry()
    for info in registry.models():
        name, schema = info.name, registry.model(info.name).spec.config_schema
        for key, field in schema.model_fields.items():
            if field.annotation is int or int in typing.get_args(field.annotation):
                for value in (32.0, True):
                    found = loose_numbers(schema, {key: value})
                    assert [k for k, _ in found] == [key], (name, key, value, found)
                checked += 1
    assert checked >= 10, checked


def test_bad_choice_lists_valid_values(project: Path) -> None:
    problems = problems_for(project, GOOD + '\nlr_scheduler = "exponential"\n'.replace("\n", "", 0))
    text = "\n".join(problems)
    # lr_scheduler is a top-level key; appended after [adapter] it lands in the adapter table
    assert "adapter.lr_scheduler" in text and "unknown key" in text
    problems = problems_for(project, 'lr_scheduler = "exponential"\n' + GOOD)
    assert "lr_scheduler" in problems[0] and "'constant', 'linear', 'cosine'" in problems[0]


def test_missing_files_are_named(project: Path) -> None:
    problems = problems_for(
        project,
        GOOD.replace('dataset = "dataset.toml"', 'dataset = "nope.toml"').replace(
            'path = "model"', 'path = "no_model"'
        ),
    )
    text = "\n".join(problems)
    assert f"dataset: file not found: {project / 'nope.toml'}" in text
    assert f"model.path: path not found: {project / 'no_model'}" in text


def test_every_problem_is_listed(project: Path) -> None:
    bad = GOOD.replace("pipeline_stages = 2", "pipeline_stages = 0\nepochz = 3").replace("rank = 4", "rank = -1")
    problems = problems_for(project, bad)
    assert len(problems) == 3, problems
    assert any("pipeline_stages" in p and "greater than or equal to 1" in p for p in problems)
    assert any("epochz" in p and "Did you mean 'epochs'" in p for p in problems)
    assert any("adapter.rank" in p for p in problems)


def test_unknown_model_type(project: Path) -> None:
    problems = problems_for(project, GOOD.replace('type = "reference"', 'type = "mochi"'))
    assert "model.type" in problems[0] and "unknown model 'mochi'" in problems[0]
    assert "pip install diffpipe-mochi" in problems[0]


def test_partition_split_must_fit_stages(project: Path) -> None:
    problems = problems_for(project, "partition_split = [2, 4]\n" + GOOD)
    assert "partition_split has 2 values but pipeline_stages=2 needs 1" in problems[0]


def test_pipeline_stages_must_divide_world_size(project: Path) -> None:
    (project / "run.toml").write_text(GOOD)
    cfg = load_config(project / "run.toml", get_registry())
    check_world_size(cfg.run, 4, "run.toml")
    with pytest.raises(ConfigError) as err:
        check_world_size(cfg.run, 3, "run.toml")
    assert "pipeline_stages: 2 does not divide the number of processes (3)" in err.value.problems[0]
    assert "valid values for 3 processes: 1, 3" in err.value.problems[0]


def test_validate_command_exit_codes(project: Path) -> None:
    (project / "run.toml").write_text(GOOD)
    ok = run_diffpipe(["validate", "--config", "run.toml", "--num-procs", "2"], cwd=project, timeout=120)
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.output
    bad = run_diffpipe(["validate", "--config", "run.toml", "--num-procs", "3"], cwd=project, timeout=120)
    assert bad.returncode == 1 and "does not divide the number of processes (3)" in bad.stderr


def test_config_reference_doc_is_in_sync() -> None:
    from diffpipe_core.docs import config_reference_markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert doc.read_text() == config_reference_markdown(), "run: diffpipe config-reference > docs/config.md"
