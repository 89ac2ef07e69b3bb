"""diffpipe-core: the plugin contract, config, data pipeline and DeepSpeed training engine."""

import pluggy

from diffpipe_core.types import EncodeBatch, LossSettings, ModelConfigBase, ModelSpec, TrainingContext

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("diffpipe")
"""Marker for plugin hook implementations: ``@diffpipe_core.hookimpl``."""

__all__ = ["EncodeBatch", "LossSettings", "ModelConfigBase", "ModelSpec", "TrainingContext", "hookimpl", "__version__"]
