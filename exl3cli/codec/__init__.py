"""The EXL3 weight codec (EXL3-FORMAT.md sections 2-5), pure PyTorch, CPU-capable.

The bottom floor of the package: it imports nothing of exl3cli but ``errors``. The
encoder's search (Viterbi) dispatches to kernels and lives in ``exl3cli.ops.viterbi``.

Public API (re-exported here; each module's docstring has the details):
- ``decode_tiles(trellis[int16, (kb, nb, 16*K)], k_bits=None, codebook="mul1")
  -> Tensor[float16, (16*kb, 16*nb)]``: the rotated weight Ŵ, bit-exact with
  ExLlamaV3's kernel; vectorised over tiles.
- ``dequantize_linear(tensors, in_features, out_features) -> Tensor[float32, (in, out)]``:
  ``W = diag(suh)·Hblk·Ŵ·Hblk·diag(svh)``, trimmed; bias is the caller's.
- ``codebook_from_tensors(tensors) -> "mul1" | "mcg" | "3inst"``.
- ``block_hadamard(x, dim, block=128)``, ``hadamard_matrix(n)``.
- ``codebook_lut(name)``, ``unpack_states`` / ``pack_states``, ``k_bits_from_words``,
  tile order helpers in ``tiles``.
"""

from exl3cli.codec.bitstream import k_bits_from_words, pack_states, unpack_states, words_per_tile
from exl3cli.codec.codebooks import CODEBOOKS, MARKER_VALUES, codebook_lut
from exl3cli.codec.dequant import (
    codebook_from_tensors,
    decode_tiles,
    dequantize_linear,
    unpack_sign_bits,
)
from exl3cli.codec.hadamard import block_hadamard, hadamard_matrix

__all__ = [
    "CODEBOOKS",
    "MARKER_VALUES",
    "block_hadamard",
    "codebook_from_tensors",
    "codebook_lut",
    "decode_tiles",
    "dequantize_linear",
    "hadamard_matrix",
    "k_bits_from_words",
    "pack_states",
    "unpack_sign_bits",
    "unpack_states",
    "words_per_tile",
]
