"""diffpipe generic plugin: Prodigy and schedule-free AdamW through ``register_optimizers``."""
