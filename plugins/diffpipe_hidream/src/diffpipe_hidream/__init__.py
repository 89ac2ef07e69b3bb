"""diffpipe-hidream: the HiDream-I1 model plugin for diffpipe."""
