"""diffpipe-reference: a tiny DiT model plugin for testing diffpipe-core and running the demo."""
