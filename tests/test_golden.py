"""The golden manifests' comparison (diffpipe_core/testing/golden.py): exact bytes, or values within RTOL where
another CPU rounds differently; anything more is named."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffpipe_core.testing.golden import RTOL, WRITE_ENV, assert_matches, differences, write_manifest


def saved(folder: Path, scale: float = 0.0, key: str = "a.lora_A.weight") -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {"a.lora_A.weight": torch.randn(4, 24, generator=g), "a.lora_B.weight": torch.randn(24, 4, generator=g)}
    noise = torch.randn(tensors[key].shape, generator=torch.Generator().manual_seed(1))
    tensors[key] = tensors[key] + scale * noise * tensors[key].norm() / noise.norm()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def test_bytes_then_values_within_rtol_then_named(tmp_path: Path) -> None:
    manifest = tmp_path / "golden.json"
    write_manifest(saved(tmp_path / "want"), manifest)
    assert differences(saved(tmp_path / "same"), manifest) == []
    assert differences(saved(tmp_path / "rounded", scale=RTOL / 20), manifest) == []  # another CPU's rounding
    found = differences(saved(tmp_path / "changed", scale=RTOL * 5), manifest)
    assert len(found) == 1 and found[0].startswith("adapter_model.safetensors: a.lora_A.weight: float32 4x24")
    assert "apart, more than" in found[0]
    value = float(found[0].split("(values ")[1].split(" ")[0])
    assert value == pytest.approx(RTOL * 5, rel=0.6)  # the projections estimate the difference's norm


def test_shape_dtype_and_keys_are_exact(tmp_path: Path) -> None:
    manifest = tmp_path / "golden.json"
    write_manifest(saved(tmp_path / "want"), manifest)
    other = tmp_path / "other"
    other.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"a.lora_A.weight": torch.randn(4, 24, generator=g).half(), "b.weight": torch.zeros(2)},
              str(other / "adapter_model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    found = differences(other, manifest)
    assert any("a.lora_A.weight: float16 4x24" in f for f in found)
    assert any("a.lora_B.weight: missing" in f for f in found)
    assert any("b.weight: not in the manifest" in f for f in found)


def test_writing_a_golden_fails_the_test_after_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = tmp_path / "golden.json"
    write_manifest(saved(tmp_path / "old", scale=0.5), manifest)
    monkeypatch.setenv(WRITE_ENV, "1")
    with pytest.raises(AssertionError, match=r"wrote .*golden\.json from .*new .*nothing was compared"):
        assert_matches(saved(tmp_path / "new"), manifest)
    monkeypatch.delenv(WRITE_ENV)
    assert differences(saved(tmp_path / "new"), manifest) == []  # written all the same
    with pytest.raises(AssertionError, match="differs from"):
        assert_matches(saved(tmp_path / "old", scale=0.5), manifest)


def test_the_test_command_refuses_to_run_while_goldens_would_be_rewritten() -> None:
    script = Path(__file__).parents[1] / "scripts" / "test.sh"
    env = {**os.environ, WRITE_ENV: "1", "PATH": "/nonexistent"}  # nothing may run, not even the setup
    result = subprocess.run([shutil.which("bash"), str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and f"{WRITE_ENV}=1 is set" in result.stderr, result.stdout + result.stderr
    assert result.stdout == ""
