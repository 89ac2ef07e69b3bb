"""Issue 20.18: the demo's model-writing step (``python -m diffpipe_flux.testing FOLDER``, as scripts/demo.sh runs
it) prints only its own line: transformers' torchvision fallbacks, DeepSpeed's accelerator line and the weight
writers' bars stay behind DIFFPIPE_VERBOSE=1, as in the CLI (the core's ``quiet_script``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from diffpipe_core.testing.processes import cli_env


def test_the_demo_model_writer_prints_one_line(tmp_path: Path) -> None:
    env = cli_env()
    env.pop("DIFFPIPE_VERBOSE", None)
    proc = subprocess.run([sys.executable, "-m", "diffpipe_flux.testing", str(tmp_path / "flux")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == f"wrote {tmp_path / 'flux'} and {tmp_path / 'flux.bfl.safetensors'}\n", proc.stdout
    assert proc.stderr == "", proc.stderr[-3000:]
