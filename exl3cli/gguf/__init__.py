"""GGUF files: read, dequantise and convert to Hugging Face folders."""
