"""diffpipe model plugin: OmniGen2."""
