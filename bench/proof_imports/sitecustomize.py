"""On the GPU proof's CPU dry run (bench/gpu_proof.sh puts this folder on PYTHONPATH), each Python process writes
the top-level modules it imported to ``$DIFFPIPE_PROOF_IMPORTS/<pid>.txt`` as it exits, so bench/proof_report.py can
name an imported package that is neither carried to the GPU machine nor in its image."""

import atexit
import os
import sys


def _write_imports() -> None:
    folder = os.environ.get("DIFFPIPE_PROOF_IMPORTS")
    if folder and os.path.isdir(folder):
        names = sorted({name.partition(".")[0] for name in list(sys.modules)})
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(names))


atexit.register(_write_imports)
