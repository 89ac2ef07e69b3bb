"""diffpipe model plugin for Z-Image (Tongyi-MAI): entry point ``z-image``."""
