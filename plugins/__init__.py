"""exl3 built-in plugins."""
