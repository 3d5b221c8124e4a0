"""Built-in architectures (registered through the exl3cli entry-point group)."""
