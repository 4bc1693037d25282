"""Integer arithmetic on static sizes: powers of two and rounding up (block widths, padded lengths).

Everything here takes and returns Python ints (shapes and launch parameters are static, part of the
jit cache key). Triton blocks must have power-of-two extents, hence most of these.
"""

from __future__ import annotations


def is_power_of_2(x) -> bool:
    """True when x is an int (not a bool) 2^k with k >= 0; False for 0, negatives and non-ints."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and not x & (x - 1)


def next_power_of_2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): 5 -> 8, 8 -> 8."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def largest_power_of_2_at_most(x: int) -> int:
    """The largest power of two <= x, for x >= 1: 5 -> 4, 8 -> 8."""
    if x < 1:
        raise ValueError(f"largest_power_of_2_at_most needs x >= 1, got {x!r}")
    return 1 << (int(x).bit_length() - 1)


def largest_power_of_2_dividing(x: int) -> int:
    """The largest power of two that divides x >= 1 (its lowest set bit): 12 -> 4, 7 -> 1."""
    return x & -x


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ for a >= 0, b >= 1 (the number of size-b blocks covering a elements)."""
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    """x rounded up to a multiple of `multiple` >= 1 (a padded length): round_up(37, 16) = 48."""
    return ceil_div(x, multiple) * multiple

