"""Text in and out: the tokenizer with streaming decode, chat templates, token-id checks."""
