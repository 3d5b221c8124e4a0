"""Whole models: CausalLM (the decoder stack), decoder-layer variants, the loader, memory
placement and offload planning, weight reading, vision towers."""
