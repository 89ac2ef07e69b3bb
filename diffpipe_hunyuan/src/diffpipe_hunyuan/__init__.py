"""diffpipe-hunyuan: the HunyuanVideo model plugin for diffpipe (entry point ``hunyuan-video``)."""

__version__ = "0.1.0"
