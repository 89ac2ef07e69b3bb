"""diffpipe-lumina: the Lumina Image 2.0 model plugin for diffpipe (entry point ``lumina2``)."""
