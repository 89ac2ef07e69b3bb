"""diffpipe-sdxl: the Stable Diffusion XL model plugin for diffpipe (entry point ``sdxl``)."""
