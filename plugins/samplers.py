"""Built-in samplers (registered through the exl3cli entry-point group)."""
