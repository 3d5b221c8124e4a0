"""The inference engine, in floors (imports run down): generation/ (the batched generator,
decode steps, sampling, speculative decoding, TextModel) > adapters/ (LoRA) > models/
(CausalLM, loader, placement, weights, vision) > layers/ (attention, MLP, MoE, linears,
norms, rotary, the fused decode layer) > kvcache/ (paged cache and its attention) >
spec/ (config.json, architectures), text/ (tokenizer, chat templates), grammar/
(structured output)."""
