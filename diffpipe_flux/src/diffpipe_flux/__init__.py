"""diffpipe-flux: the Flux (dev, schnell) model plugin for diffpipe (entry point ``flux``)."""

__version__ = "0.1.0"
