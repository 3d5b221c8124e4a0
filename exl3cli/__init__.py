"""exl3: run, serve and quantize EXL3 language models."""

__version__ = "0.1.0"
