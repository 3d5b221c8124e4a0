"""Kernels and their PyTorch twins: the extension builder (build.py), the CUDA kernels
(cuda_kernels.py, layer_kernels.py, cuda_viterbi.py), the CPU kernels (cpu_kernels.py),
the one reference twin of each shared formula (reference.py) and the encoder's Viterbi
search with its dispatch (viterbi.py). Imports only the codec below it."""
