"""diffpipe-ltx: the LTX-Video model plugin for diffpipe (entry point ``ltx-video``)."""

__version__ = "0.1.0"
