"""What a model is, as data: config.json parsed (config.py) and architecture specs found
through the plugin hook (architecture.py)."""
