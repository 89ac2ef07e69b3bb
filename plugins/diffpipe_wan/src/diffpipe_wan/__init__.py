"""diffpipe-wan: Wan 2.1 / 2.2 text-to-video (``wan``) and image-to-video (``wan-i2v``) on diffpipe."""
