"""diffpipe-sd3: the Stable Diffusion 3 / 3.5 model plugin for diffpipe."""
