"""diffpipe model plugin for ERNIE-Image (Baidu): entry point ``ernie-image``."""
