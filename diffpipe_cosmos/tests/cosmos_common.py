"""What the Cosmos tests share: the plugin objects by entry-point name and the tiny models' ``[model]`` table."""

from __future__ import annotations

from pathlib import Path

from diffpipe_core.schema import validate
from diffpipe_cosmos.plugin import cosmos1, predict2

PLUGINS = {"cosmos": cosmos1, "cosmos-predict2": predict2}
VARIANTS = {"cosmos": "1.0", "cosmos-predict2": "predict2"}


def config(name: str, path: Path, **kw):
    """The validated ``[model]`` table of entry point ``name`` for a tiny model (float32, 16 T5 tokens)."""
    table = {"type": name, "path": path, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 16, **kw}
    return validate(PLUGINS[name].spec.config_schema, table, "test")
