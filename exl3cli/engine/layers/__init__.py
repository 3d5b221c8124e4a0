"""Model building blocks: attention, MLP, mixture of experts, multi-head latent attention,
linears (dense, EXL3, CPU, offloaded, fused), norms, rotary, the fused GPU decode layer."""
