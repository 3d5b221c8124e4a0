"""The paged key/value cache: page pool and tables, quantized pages, attention over pages
and the attention arithmetic it shares with the layers; `AttentionCache`
(attention_cache.py) is the protocol every cache step handed to a forward pass meets."""
