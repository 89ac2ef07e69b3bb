"""diffpipe model plugin for Ideogram 4 (``ideogram4``)."""
