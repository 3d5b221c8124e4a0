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


def _mixtral_8x7b_like(layers: int = 32) -> list[GroupShape]:
    # hidden 4096, 8 kv heads of 128, 8 experts of 14336: attention ~3% of the weights.
    sizes = {"qkv": 4096 * (4096 + 2 * 1024), "o": 4096 * 4096,
             "gate_up": 8 * 2 * 4096 * 14336, "down": 8 * 14336 * 4096}
    return [GroupShape(i, g, n) for i in range(layers) for g, n in sizes.items()]


@pytest.mark.parametrize("bpw", [3.0, 4.0, 4.5])
def test_moe_attention_gets_two_more_bits_paid_by_the_experts(bpw):
    shapes = _mixtral_8x7b_like()
    bits = allocate_bits(shapes, bpw, attention_bonus=2)
    average = average_bits(shapes, bits)
    assert bpw - 0.05 <= average <= bpw + 1e-9
    base = int(bpw)
    assert all(bits[(i, g)] >= base + 2 for i in range(32) for g in ("qkv", "o"))
    experts = [bits[(i, g)] for i in range(32) for g in ("gate_up", "down")]
    assert sum(e >= base for e in experts) > len(experts) // 2
    # At a whole-number target some experts pay a bit; with a fraction to spend, none.
    assert min(experts) == (base - 1 if bpw == base else base)
    # Without the bonus every expert group keeps the base width.
    plain = allocate_bits(shapes, bpw)
    assert min(plain[(i, "gate_up")] for i in range(32)) == base


def _tiny_moe(attention_blocks: int = 4) -> list[GroupShape]:
    # The tiny Mixtral of test_convert_moe.py: attention a quarter of the weights.
    block = 128 * 128
    return [GroupShape(i, g, n) for i in range(2) for g, n in
            {"qkv": 3 * block, "o": (attention_blocks - 3) * block, "gate_up": 8 * block,
             "down": 4 * block}.items()]


def test_a_tiny_moe_pays_for_attention_with_its_gate_up_experts():
    shapes = _tiny_moe()
    bits = allocate_bits(shapes, 4.0, attention_bonus=2)
    assert average_bits(shapes, bits) <= 4.0 + 1e-9
    assert all(bits[(i, g)] == 6 for i in range(2) for g in ("qkv", "o"))
    assert all(bits[(i, "gate_up")] == 3 and bits[(i, "down")] == 4 for i in range(2))


def test_the_bonus_shrinks_when_the_experts_cannot_pay_for_all_of_it():
    # Attention as large as the experts: one expert bit pays for one attention bit.
    shapes = _tiny_moe(attention_blocks=12)
    bits = allocate_bits(shapes, 4.0, attention_bonus=2)
    assert average_bits(shapes, bits) <= 4.0 + 1e-9
    assert all(bits[(i, g)] == 5 for i in range(2) for g in ("qkv", "o"))
    assert all(bits[(i, g)] == 3 for i in range(2) for g in ("gate_up", "down"))
    # Experts never go below two bits: at 2.0 bpw nothing can pay, the plain allocation.
    assert allocate_bits(shapes, 2.0, attention_bonus=2) == allocate_bits(shapes, 2.0)
