"""The EXL3 weight codec (EXL3-FORMAT.md sections 2-5), pure PyTorch, CPU-capable.

Public API (re-exported here; each module's docstring has the details):
- ``decode_tiles(trellis[int16, (kb, nb, 16*K)], k_bits=None, codebook="mul1")
  -> Tensor[float16, (16*kb, 16*nb)]``: the rotated weight Ŵ, bit-exact with
  ExLlamaV3's kernel; vectorised over tiles.
- ``encode_tiles(values[(kb, nb, 16, 16)] or [(in, out)], k_bits, codebook="mul1")
  -> trellis int16 (kb, nb, 16*K)``: tail-biting Viterbi search + packing. Values must
  already be scaled to the codebook (unit RMS for mul1).
- ``viterbi_states(targets[N, 256], k_bits, codebook) -> states[int64, (N, 256)]``.
- ``dequantize_linear(tensors, in_features, out_features) -> Tensor[float32, (in, out)]``:
  ``W = diag(suh)·Hblk·Ŵ·Hblk·diag(svh)``, trimmed; bias is the caller's.
- ``codebook_from_tensors(tensors) -> "mul1" | "mcg" | "3inst"``.
- ``block_hadamard(x, dim, block=128)``, ``hadamard_matrix(n)``.
- ``codebook_lut(name)``, ``unpack_states`` / ``pack_states``, ``k_bits_from_words``,
  tile order helpers in ``tiles``.
"""

from .bitstream import k_bits_from_words, pack_states, unpack_states, words_per_tile
from .codebooks import CODEBOOKS, MARKER_VALUES, codebook_lut
from .dequant import codebook_from_tensors, decode_tiles, dequantize_linear, unpack_sign_bits
from .hadamard import block_hadamard, hadamard_matrix
from .viterbi import encode_tiles, viterbi_states

__all__ = [
    "CODEBOOKS",
    "MARKER_VALUES",
    "block_hadamard",
    "codebook_from_tensors",
    "codebook_lut",
    "decode_tiles",
    "dequantize_linear",
    "encode_tiles",
    "hadamard_matrix",
    "k_bits_from_words",
    "pack_states",
    "unpack_sign_bits",
    "unpack_states",
    "viterbi_states",
    "words_per_tile",
]
