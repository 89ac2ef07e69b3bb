"""Issue 20.12: a save that does not fit on its disk names the folder, what it needed and what was free, removes
its partial folder and leaves the previous checkpoint and adapter as they were. The disk is a real 200 kB tmpfs,
mounted in a user namespace of its own (``unshare``), where the writes run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import subprocess, sys, torch
    from pathlib import Path
    from peft import LoraConfig
    from diffpipe_core.engine import checkpoint as ckpt
    from diffpipe_core.engine.saving import write_adapter
    from diffpipe_core.registry import get_registry

    disk = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)], check=True)
    run = disk / "run"

    def checkpoint(step, numel):
        return ckpt.write_checkpoint(run, step, rank=0, stage_id=0, dp_rank=0, params={"w": torch.ones(numel)},
                                     optimizer_state={"state": {}}, train_state={"step": step}, keep=2,
                                     barrier=lambda: None)

    checkpoint(2, 1000)
    try:
        checkpoint(4, 100_000)  # 400 kB
    except OSError as exc:
        print("CHECKPOINT:", exc)
    print("LEFT:", sorted(p.name for p in (run / "checkpoints").iterdir()))
    plugin = get_registry().model("reference")
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"])
    small = {"blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 4), "blocks.0.attn.to_q.lora_B.weight": torch.ones(4, 2)}
    write_adapter(run / "saved" / "final", small, plugin, config, ["diffusers"], torch.float32)
    big = {k: torch.ones(100_000) for k in small}
    try:
        write_adapter(run / "saved" / "final", big, plugin, config, ["diffusers"], torch.float32)
    except OSError as exc:
        print("ADAPTER:", exc)
    print("SAVED:", sorted(p.name for p in (run / "saved").iterdir()), (run / "saved/final").is_dir())
""")


def test_a_full_disk_names_the_folder_and_sizes_and_removes_the_partial_save(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", SCRIPT, str(disk)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if "mount" in proc.stderr and proc.returncode != 0 and "CHECKPOINT" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    message = lines["CHECKPOINT"]
    assert message.startswith(f"no space left on the device of {disk}/run/checkpoints while writing stage 0's part")
    assert re.search(r"it needs about 40\d\.\d KB, \d+\.\d KB is free", message), message
    assert "removed the partial .tmp-step-0000004, checkpoints/step-0000002 is intact" in message
    assert lines["LEFT"] == "['latest', 'step-0000002']"  # no .tmp-step-0000004 left behind
    assert "the adapter" in lines["ADAPTER"] and "needs about 800.0 KB" in lines["ADAPTER"]
    assert f"{disk}/run/saved/final keeps its previous content" in lines["ADAPTER"]
    assert lines["SAVED"] == "['final'] True"
