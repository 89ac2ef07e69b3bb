"""diffpipe-qwenimage: the Qwen-Image (``qwen-image``) and Qwen-Image-Edit (``qwen-image-edit``) model plugins."""

__version__ = "0.1.0"
