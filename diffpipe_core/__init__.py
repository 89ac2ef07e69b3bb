"""diffpipe-core: the plugin contract, config, data pipeline and DeepSpeed training engine."""

import pluggy

from diffpipe_core.types import AudioSpec, EncodeBatch, LossSettings, ModelConfigBase, ModelSpec, TrainingContext

__version__ = "0.1.0"

CONTRACT_VERSION = 4
"""The version of the plugin contract (the hooks, the types that cross the boundary, the kit's rules) this core
implements; ``CHANGELOG.md`` says what each version changed and what a plugin author must do. A plugin declares
the version it needs as ``ModelSpec(contract=...)``; the registry refuses, by name, one that needs a newer core."""

hookimpl = pluggy.HookimplMarker("diffpipe")
"""Marker for plugin hook implementations: ``@diffpipe_core.hookimpl``."""

__all__ = [
    "AudioSpec",
    "CONTRACT_VERSION",
    "EncodeBatch",
    "LossSettings",
    "ModelConfigBase",
    "ModelSpec",
    "TrainingContext",
    "hookimpl",
    "__version__",
]
