"""diffpipe-auraflow: the AuraFlow model plugin for diffpipe (entry point ``auraflow``)."""
