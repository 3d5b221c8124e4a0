"""exl3: run, serve and quantize EXL3 language models."""

from exl3cli.torch_notices import silence_torch_notices

__version__ = "0.1.0"

silence_torch_notices()
