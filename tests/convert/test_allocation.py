import pytest

from exl3cli.convert.allocation import (
    GroupShape,
    allocate_bits,
    average_bits,
    ends_first,
    promotion_order,
)
from exl3cli.errors import ConversionError


def _smollm2_like(layers: int = 30) -> list[GroupShape]:
    # Padded sizes of SmolLM2-135M: hidden 576 -> 640, kv 192 -> 256, mlp 1536.
    sizes = {"qkv": 640 * (640 + 256 + 256), "o": 640 * 640,
             "gate_up": 2 * 640 * 1536, "down": 1536 * 640}
    return [GroupShape(i, g, n) for i in range(layers) for g, n in sizes.items()]


@pytest.mark.parametrize("bpw", [2.0, 2.25, 2.5, 3.1, 3.7, 4.0, 4.5, 5.0, 7.9])
def test_average_meets_target_within_tolerance(bpw):
    shapes = _smollm2_like()
    bits = allocate_bits(shapes, bpw)
    average = average_bits(shapes, bits)
    assert bpw - 0.05 <= average <= bpw + 1e-9
    assert set(bits.values()) <= {int(bpw), int(bpw) + 1}


def test_ends_first_order():
    assert ends_first(5) == [0, 4, 1, 3, 2]
    assert ends_first(4) == [0, 3, 1, 2]


def test_attention_promoted_before_mlp_and_ends_first():
    shapes = _smollm2_like(10)
    # A budget that promotes every attention group and a few MLP groups.
    attention = sum(s.weights for s in shapes if s.group in ("qkv", "o"))
    total = sum(s.weights for s in shapes)
    bpw = 3 + (attention + 3 * 1536 * 640) / total
    bits = allocate_bits(shapes, bpw)
    assert all(bits[(i, g)] == 4 for i in range(10) for g in ("qkv", "o"))
    promoted_mlp = sorted(i for (i, g), b in bits.items() if g == "down" and b == 4)
    assert promoted_mlp == [0, 1, 9]
    assert all(bits[(i, "gate_up")] == 3 for i in range(10))


def test_budget_smaller_than_any_attention_group_promotes_nothing_there():
    shapes = _smollm2_like(4)
    bits = allocate_bits(shapes, 3.001)
    assert set(bits.values()) == {3}
    order = promotion_order(4)
    assert order[:4] == [(0, "qkv"), (3, "qkv"), (1, "qkv"), (2, "qkv")]


def test_out_of_range_bits_rejected():
    with pytest.raises(ConversionError):
        allocate_bits(_smollm2_like(2), 9.0)
