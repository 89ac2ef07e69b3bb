"""diffpipe-cosmos: NVIDIA Cosmos model plugins for diffpipe (entry points ``cosmos`` and ``cosmos-predict2``)."""

__version__ = "0.1.0"
