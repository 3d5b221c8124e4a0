"""Built-in sources (registered through the exl3cli entry-point group)."""
