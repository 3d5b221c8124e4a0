"""CPU check of two pieces of csrc/ops/cuda/gemm_lean.cuh that no GPU was there to run:
(1) the states each lane extracts (compile-time positions in the raw words at K = 4 and
8, PRMT for byte-aligned ones) equal decode_lane's (exl3_trellis.cuh: runtime funnel
normalisation + window16), for every K2 and lane on random tiles; (2) one u8
m16n8k32 mma with gemm_lean's constant B operand returns, in each lane, the byte sums of
its own A registers (order a0, a2, a1, a3; + C), under the PTX ISA fragment layouts.
A Python mirror of the CUDA code: it checks the arithmetic, not the hardware (the cuda
tests do that). Usage: python3 bench/gemm_lean_check.py
"""

from __future__ import annotations

import random

MASK = 0xFFFFFFFF


def steps(k2: int, i: int) -> int:
    """TileBits<K2>::S(i): bits consumed after step i."""
    ka = k2 // 2
    return (i + 1) * ka + (i + 1) // 2 if k2 & 1 else (i + 1) * ka


def tile_bits(k2: int) -> tuple[int, int, int, int]:
    ka = k2 // 2
    ring = 256 * ka + 128 if k2 & 1 else 256 * ka
    span = steps(k2, 7) - steps(k2, 0) + 16
    return ring, ring // 32, span, (span + 31) // 32 + 1


def funnel_l(lo: int, hi: int, shift: int) -> int:
    """CUDA __funnelshift_l(lo, hi, shift): high word of (hi:lo) << (shift & 31)."""
    return ((((hi << 32) | lo) << (shift & 31)) >> 32) & MASK


def byte_perm(x: int, y: int, sel: int) -> int:
    b = [(x >> (8 * i)) & 255 for i in range(4)] + [(y >> (8 * i)) & 255 for i in range(4)]
    return sum(b[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def window16(n: list[int], pos: int) -> int:
    wi, b = pos >> 5, pos & 31
    if b <= 16:
        return (n[wi] >> (16 - b)) & 0xFFFF
    return funnel_l(n[wi + 1], n[wi], b) >> 16


def bits16(w: list[int], pos: int) -> int:
    a, b = pos >> 5, pos & 31
    assert a < len(w) and (b <= 16 or a + 1 < len(w)), (pos, len(w))
    if b == 0:
        return w[a] >> 16
    if b == 16:
        return w[a] & 0xFFFF
    if b == 8:
        return byte_perm(w[a], 0, 0x4421)
    if b < 16:
        return (w[a] >> (16 - b)) & 0xFFFF
    return funnel_l(w[a + 1], w[a], b) >> 16


def cost16(pos: int) -> int:
    return 1 if (pos & 31) in (0, 8, 16) else 2


def check_states(trials: int = 20) -> None:
    for k2 in range(2, 17):
        ring, words, span, load = tile_bits(k2)
        fixed = k2 % 8 == 0
        koff = (steps(k2, 0) - 16 + ring) % 32
        lean_load = (koff + span + 31) // 32 if fixed else load
        for _ in range(trials):
            tile = [random.getrandbits(32) for _ in range(words)]
            for lane in range(32):
                start = (steps(k2, 8 * lane) - 16 + ring) % ring
                w0, off = start >> 5, start & 31
                w = [tile[(w0 + i) % words] for i in range(load)]
                n = [funnel_l(w[i + 1], w[i], off) for i in range(load - 1)]
                want = [window16(n, steps(k2, j) - steps(k2, 0)) for j in range(8)]
                assert not fixed or off == koff
                wl = [tile[(w0 + i) % words] for i in range(lean_load)]
                nl = [funnel_l(wl[i + 1], wl[i], koff if fixed else off)
                      for i in range(lean_load - 1)]
                got = []
                for j in range(8):
                    q = steps(k2, j) - steps(k2, 0)
                    p = koff + q
                    fits = (q >> 5) < lean_load - 1 and ((q & 31) <= 16 or (q >> 5) + 2 < lean_load)
                    use_n = not fixed or (fits and cost16(q) < cost16(p))
                    got.append(bits16(nl, q) if use_n else bits16(wl, p))
                assert got == want, (k2, lane)
        print(f"K2={k2:2}: states equal decode_lane's (words loaded {load} -> {lean_load})")


def mma_u8(a_regs: list[list[int]], b_regs: list[list[int]], c: int) -> list[list[int]]:
    """mma.m16n8k32.row.col.s32.u8.u8.s32 with every C element c, per PTX layouts."""
    a = [[0] * 32 for _ in range(16)]
    b = [[0] * 8 for _ in range(32)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, col) in enumerate([(g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t),
                                        (g + 8, 16 + 4 * t)]):
            for i in range(4):
                a[row][col + i] = (a_regs[lane][r] >> (8 * i)) & 255
        for r, k in enumerate([4 * t, 16 + 4 * t]):
            for i in range(4):
                b[k + i][g] = (b_regs[lane][r] >> (8 * i)) & 255
    d = [[c + sum(a[m][k] * b[k][n] for k in range(32)) for n in range(8)] for m in range(16)]
    return [[d[lane >> 2][2 * (lane & 3)], d[lane >> 2][2 * (lane & 3) + 1],
             d[(lane >> 2) + 8][2 * (lane & 3)], d[(lane >> 2) + 8][2 * (lane & 3) + 1]]
            for lane in range(32)]


def check_byte_sums() -> None:
    b_regs = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        sigma = (g >> 1) + 4 * (g & 1)
        b_regs.append([0x01010101 if sigma == t else 0, 0x01010101 if sigma == t + 4 else 0])
    a_regs = [[random.getrandbits(32) for _ in range(4)] for _ in range(32)]
    d = mma_u8(a_regs, b_regs, 0x6400)

    def total(x: int) -> int:
        return sum((x >> (8 * i)) & 255 for i in range(4)) + 0x6400

    for lane, a in enumerate(a_regs):
        assert d[lane] == [total(a[0]), total(a[2]), total(a[1]), total(a[3])], lane
    print("u8 mma: every lane gets its own registers' byte sums (a0, a2, a1, a3) + C")


if __name__ == "__main__":
    random.seed(1)
    check_states()
    check_byte_sums()
