"""Generation: the batched generator over the paged cache, its jobs, fixed-shape decode
steps replayed from CUDA graphs, sampling, speculative decoding, text events and
TextModel (a model with its tokenizer and template)."""
