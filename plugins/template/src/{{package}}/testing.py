"""A tiny random-weight {{name}}
on disk in its real layout, for tests and demos: a diffusers folder (``model_index.json``, ``transformer/``,
``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``), each component built from a config in-process (no
download) by :mod:`diffpipe_core.testing.tiny`.

    python -m {{package}}.testing FOLDER
"""

from __future__ import annotations

import sys
from pathlib import Path

from diffpipe_core.testing import tiny


def parts() -> dict[str, tiny.Part]:
    """The components in build order, each after its seed (together they fix every random weight)."""
    from {{package}}.model import TinyDiT

    tokenizer = tiny.t5_tokenizer()
    return {
        "transformer": tiny.Part(lambda: TinyDiT(in_channels=4, text_dim=32), seed=0),
        "vae": tiny.Part(lambda: tiny.{{vae_builder}}(latent_channels=4), seed=1),
        "text_encoder": tiny.Part(lambda: tiny.t5_encoder(tokenizer, dim=32), seed=2),
        "tokenizer": tiny.Part(lambda: tokenizer),
        "scheduler": tiny.Part(lambda: tiny.flow_scheduler(shift=3.0)),  # what samples step with
    }


def write_tiny_model(folder: Path | str) -> Path:
    """Write the tiny model folder and return it."""
    return tiny.write_folder("{{class_name}}Pipeline", parts(), Path(folder))


if __name__ == "__main__":
    print(f"wrote {write_tiny_model(sys.argv[1])}")
