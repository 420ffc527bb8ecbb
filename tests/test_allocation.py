"""The mixed-precision allocation on score tables with known optimal answers: a brute-force
reference over every combination of small random tables, hand-made tables whose answer is
obvious, a dynamic programme over bytes for a realistic-size one, and the input errors.

Random costs are multiples of a power of two, so that every sum is exact in floating point and
equal costs are equal floats: the brute force and `allocate` then agree to the last bit on the
cost and, through the tie rule, on the bytes."""

from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np
import pytest

from quantgate.core.errors import InputError
from quantgate.quantize.allocation import (
    TIE_TOLERANCE,
    Allocation,
    Option,
    Unit,
    allocate,
    largest_useful_bytes,
    smallest_bytes,
)

FORMATS = ("gptq-int4", "smoothquant-w8a8", "16-bit")


def unit(name: str, *options: tuple[str, int, float]) -> Unit:
    return Unit(name, tuple(Option(format_, size, cost) for format_, size, cost in options))


def brute_force(units: list[Unit], budget: int) -> tuple[float, int]:
    """(least cost, fewest bytes at that cost) over every combination within the budget."""
    best: tuple[float, int] | None = None
    for combination in itertools.product(*(each.options for each in units)):
        size = sum(option.bytes for option in combination)
        if size <= budget:
            key = (math.fsum(option.cost for option in combination), size)
            best = key if best is None or key < best else best
    assert best is not None
    return best


def random_table(rng: random.Random) -> list[Unit]:
    """3-6 units of 2-3 formats; sizes up to 5000 bytes (equal sizes and free formats happen);
    costs on a grid of 1/64 or, for some tables, of 2**-30 (tiny)."""
    grid = rng.choice([2.0**-6, 2.0**-30])
    units = []
    for index in range(rng.randint(3, 6)):
        formats = rng.sample(FORMATS, rng.randint(2, 3))
        units.append(Unit(f"model.layers.{index}.mlp.down_proj", tuple(
            Option(format_, rng.randint(1, 5000), rng.randint(0, 40) * grid) for format_ in formats)))
    return units


def test_allocate_matches_brute_force_on_random_tables() -> None:
    checked = 0
    for seed in range(200):
        rng = random.Random(seed)
        units = random_table(rng)
        floor, ceiling = smallest_bytes(units), sum(max(option.bytes for option in each.options) for each in units)
        edge = sum(rng.choice(each.options).bytes for each in units)  # some combination's exact size
        for budget in {edge, edge - 1, rng.randint(floor, ceiling)}:
            if budget < floor:
                continue
            result = allocate(units, budget)
            assert result.bytes <= budget
            assert (result.cost, result.bytes) == brute_force(units, budget), (seed, budget)
            options = {(each.name, option.format): option for each in units for option in each.options}
            assert result.bytes == sum(options[name, format_].bytes for name, format_ in result.choice.items())
            checked += 1
    assert checked > 500


def test_budget_at_the_smallest_allocation_takes_the_smallest_formats() -> None:
    units = [unit(f"g{index}", ("gptq-int4", 10, 0.5), ("smoothquant-w8a8", 20, 0.25), ("16-bit", 40, 0.0))
             for index in range(3)]
    result = allocate(units, smallest_bytes(units))
    assert result.choice == {"g0": "gptq-int4", "g1": "gptq-int4", "g2": "gptq-int4"}
    assert (result.bytes, result.cost, result.budget) == (30, 1.5, 30)


def test_budget_that_fits_the_lowest_cost_formats_takes_them_all() -> None:
    units = [unit("a", ("gptq-int4", 10, 0.5), ("smoothquant-w8a8", 20, 0.25), ("16-bit", 40, 0.0)),
             unit("b", ("gptq-int4", 10, 0.0), ("16-bit", 40, 0.0)),  # 16-bit buys nothing here
             unit("c", ("gptq-int4", 10, 0.5), ("smoothquant-w8a8", 20, 0.0), ("16-bit", 40, 0.0))]
    assert largest_useful_bytes(units) == 40 + 10 + 20
    for budget in (70, 71, 10**9):
        result = allocate(units, budget)
        assert result.choice == {"a": "16-bit", "b": "gptq-int4", "c": "smoothquant-w8a8"}
        assert (result.bytes, result.cost) == (70, 0.0)


def test_the_most_sensitive_group_gets_the_higher_precision_first() -> None:
    units = [unit(name, ("gptq-int4", 100, cost), ("16-bit", 400, 0.0))
             for name, cost in [("q", 0.1), ("down", 0.5), ("up", 0.2)]]
    one_upgrade = allocate(units, 300 + 300)
    assert one_upgrade.choice == {"q": "gptq-int4", "down": "16-bit", "up": "gptq-int4"}
    two_upgrades = allocate(units, 300 + 600)
    assert two_upgrades.choice == {"q": "gptq-int4", "down": "16-bit", "up": "16-bit"}
    assert one_upgrade.cost == pytest.approx(0.3)
    assert two_upgrades.cost == pytest.approx(0.1)


def test_optimum_where_greedy_by_cost_per_byte_is_wrong() -> None:
    # Upgrading "a" saves 7 for 6 bytes (the best ratio), "b" and "c" 5 for 5 each; with 10
    # bytes of room greedy takes "a" and has no room for more (saves 7); "b" + "c" save 10.
    units = [unit("a", ("gptq-int4", 10, 7.0), ("16-bit", 16, 0.0)),
             unit("b", ("gptq-int4", 10, 5.0), ("16-bit", 15, 0.0)),
             unit("c", ("gptq-int4", 10, 5.0), ("16-bit", 15, 0.0))]
    result = allocate(units, 40)
    assert result.choice == {"a": "gptq-int4", "b": "16-bit", "c": "16-bit"}
    assert (result.cost, result.bytes) == (7.0, 40)


def test_a_middle_format_for_everyone_beats_mixing_the_extremes() -> None:
    units = [unit(f"model.layers.{index}.self_attn.qkv_proj", ("gptq-int4", 25, 1.0),
                  ("smoothquant-w8a8", 50, 0.125), ("16-bit", 100, 0.0)) for index in range(4)]
    result = allocate(units, 200)  # all W8A8 (cost 0.5), or one 16-bit and three INT4 (cost 3.0)
    assert result.by_format() == {"smoothquant-w8a8": [f"model.layers.{index}.self_attn.qkv_proj" for index in range(4)]}
    assert result.cost == 0.5


def test_raising_the_budget_never_raises_the_cost() -> None:
    for seed in range(5):
        rng = random.Random(100 + seed)
        units = random_table(rng)
        floor, ceiling = smallest_bytes(units), largest_useful_bytes(units)
        budgets = sorted({floor, ceiling, *(rng.randint(floor, ceiling) for _ in range(12))})
        costs = [allocate(units, budget).cost for budget in budgets]
        assert costs == sorted(costs, reverse=True)
        assert costs[-1] == math.fsum(min(option.cost for option in each.options) for each in units)


def test_equal_costs_break_toward_fewer_bytes() -> None:
    # Cost 2 three ways within 45 bytes: a 16-bit + b INT4 (40 bytes), a INT4 + b 16-bit (41),
    # both middle (45). The fewest bytes win.
    units = [unit("a", ("gptq-int4", 10, 2.0), ("smoothquant-w8a8", 20, 1.0), ("16-bit", 30, 0.0)),
             unit("b", ("gptq-int4", 10, 2.0), ("smoothquant-w8a8", 25, 1.0), ("16-bit", 31, 0.0))]
    results = [allocate(units, 45) for _ in range(3)] + [allocate(list(reversed(units)), 45)]
    for result in results:
        assert result.choice == {"a": "16-bit", "b": "gptq-int4"}
        assert (result.cost, result.bytes) == (2.0, 40)


def test_costs_equal_but_for_float_rounding_are_tied() -> None:
    # Upgrading "c" saves 0.1 + 0.2 in 35 bytes; upgrading "a" and "b" saves 0.3 in 40. Equal in
    # exact arithmetic (the floats differ in the last bit), so the fewer bytes win.
    units = [unit("a", ("gptq-int4", 10, 0.1), ("16-bit", 30, 0.0)),
             unit("b", ("gptq-int4", 10, 0.2), ("16-bit", 30, 0.0)),
             unit("c", ("gptq-int4", 10, 0.3), ("16-bit", 45, 0.0))]
    assert 0.1 + 0.2 != 0.3
    tied = allocate(units, 70)
    assert tied.choice == {"a": "gptq-int4", "b": "gptq-int4", "c": "16-bit"}
    assert tied.bytes == 65
    # A real difference (far above TIE_TOLERANCE) is no tie: the cheaper allocation wins, larger.
    cheaper = [units[0], units[1], unit("c", ("gptq-int4", 10, 0.3 - 1e-3), ("16-bit", 45, 0.0))]
    assert 1e-3 > 100 * TIE_TOLERANCE * 0.3
    assert allocate(cheaper, 70).choice == {"a": "16-bit", "b": "16-bit", "c": "gptq-int4"}


def test_a_dominated_format_is_never_chosen() -> None:
    units = [unit("a", ("gptq-int4", 10, 1.0), ("smoothquant-w8a8", 20, 1.0), ("16-bit", 40, 0.0)),
             unit("b", ("16-bit", 40, 0.0), ("smoothquant-w8a8", 40, 0.5))]  # same size, dearer
    result = allocate(units, 10**6)
    assert result.choice == {"a": "16-bit", "b": "16-bit"}
    assert allocate(units, 60).choice == {"a": "gptq-int4", "b": "16-bit"}  # not the equal-cost W8A8


def test_all_free_formats_take_the_fewest_bytes() -> None:
    units = [unit(f"g{index}", ("16-bit", 40, 0.0), ("smoothquant-w8a8", 20, 0.0), ("gptq-int4", 10, 0.0))
             for index in range(3)]
    result = allocate(units, 1000)
    assert set(result.choice.values()) == {"gptq-int4"}
    assert (result.bytes, result.cost) == (30, 0.0)


def test_by_format_and_json_round_trip() -> None:
    units = [unit(name, ("gptq-int4", 10, cost), ("16-bit", 40, 0.0))
             for name, cost in [("g0", 1.0), ("g1", 3.0), ("g2", 2.0), ("g3", 4.0)]]
    result = allocate(units, 40 + 60)
    assert result.by_format() == {"gptq-int4": ["g0", "g2"], "16-bit": ["g1", "g3"]}
    data = result.to_json()
    assert data == {"budget": 100, "bytes": 100, "cost": 3.0,
                    "choice": {"g0": "gptq-int4", "g1": "16-bit", "g2": "gptq-int4", "g3": "16-bit"}}
    assert Allocation.from_json(data) == result
    assert list(Allocation.from_json(data).choice) == ["g0", "g1", "g2", "g3"]
    with pytest.raises(InputError, match="not an allocation"):
        Allocation.from_json({"choice": {}, "bytes": 1})


def exact_optimum(units: list[Unit], budget: int, grain: int) -> float:
    """The least cost within the budget by a dynamic programme over bytes, exact when every
    size is a multiple of `grain`: best[c] = least cost of the units so far in at most c grains."""
    assert all(option.bytes % grain == 0 for each in units for option in each.options)
    capacity = budget // grain
    best = np.zeros(capacity + 1)
    for each in units:
        step = np.full(capacity + 1, np.inf)
        for option in each.options:
            size = option.bytes // grain
            step[size:] = np.minimum(step[size:], best[:capacity + 1 - size] + option.cost)
        best = step
    return float(best[capacity])


def realistic_units(seed: int, *, grain: int = 4096, scale: int = 1) -> list[Unit]:
    """120 groups: 16-bit 1.6-3.6 MB, W8A8 half of it, INT4 a quarter, each plus `grain` bytes of
    scales; costs 1e-5..1e-2 nats; sizes multiples of `grain` (as tensor sizes are), times
    `scale`."""
    rng = random.Random(seed)
    units = []
    for index in range(120):
        quarter = rng.randint(400_000 // grain, 900_000 // grain) * grain
        int4 = rng.uniform(1e-4, 1e-2)
        units.append(unit(f"g{index}", ("gptq-int4", (quarter + grain) * scale, int4),
                          ("smoothquant-w8a8", (2 * quarter + grain) * scale, int4 * rng.uniform(0.02, 0.3)),
                          ("16-bit", 4 * quarter * scale, 0.0)))
    return units


def test_realistic_size_is_fast_exact_and_within_budget() -> None:
    units = realistic_units(0)
    floor, ceiling = smallest_bytes(units), largest_useful_bytes(units)
    allocate(units, ceiling)  # scipy's import, out of the timing
    for share in (0.2, 0.5, 0.8):
        budget = floor + int((ceiling - floor) * share)
        start = time.process_time()  # CPU seconds: other work on the machine does not count
        result = allocate(units, budget)
        assert time.process_time() - start < 1.0
        assert result.bytes <= budget
        optimum = exact_optimum(units, budget, 4096)
        top = max(option.cost for each in units for option in each.options)
        assert optimum - 1e-12 <= result.cost <= optimum + TIE_TOLERANCE * top
        assert len(result.choice) == 120


def test_gigabyte_sizes_never_exceed_the_budget() -> None:
    # With 3 GB size steps HiGHS accepts a choice about a kilobyte over the bound (its relative
    # tolerance); the integer check must catch it and solve again.
    units = realistic_units(1, grain=1, scale=1000)
    ceiling = largest_useful_bytes(units)
    for budget in (ceiling - 1, ceiling - 1000, ceiling - 4096, smallest_bytes(units) + 1):
        result = allocate(units, budget)
        assert result.bytes <= budget
        assert result.cost > 0  # the all-16-bit allocation does not fit
    assert allocate(units, ceiling).cost == 0.0


@pytest.mark.parametrize(("units", "budget", "words"), [
    ([], 100, "no layer groups"),
    ([Unit("g0", ())], 100, "g0 has no format options"),
    ([unit("g0", ("gptq-int4", 10, 0.1), ("gptq-int4", 20, 0.0))], 100, "gptq-int4 twice"),
    ([unit("g0", ("gptq-int4", -1, 0.1))], 100, "g0, format gptq-int4: size .* >= 0, got -1"),
    ([unit("g0", ("gptq-int4", 10, -0.5))], 100, "g0, format gptq-int4: cost .* >= 0, got -0.5"),
    ([unit("g0", ("gptq-int4", 10, math.nan))], 100, "cost must be a finite number >= 0, got nan"),
    ([unit("g0", ("gptq-int4", 10, math.inf))], 100, "cost must be a finite number >= 0, got inf"),
    ([unit("g0", ("16-bit", 10, 0.0)), unit("g0", ("16-bit", 10, 0.0))], 100, "duplicate layer group name g0"),
    ([unit("g0", ("gptq-int4", 10, 0.1), ("16-bit", 40, 0.0)), unit("g1", ("gptq-int4", 15, 0.1))], 24,
     r"budget of 24 bytes is below the smallest allocation, 25 bytes \(every group at its smallest format\)"),
    ([unit("g0", ("gptq-int4", 10, 0.1))], 10.5, "whole number of bytes"),
])
def test_bad_input_is_an_input_error(units: list[Unit], budget: int, words: str) -> None:
    with pytest.raises(InputError, match=words) as caught:
        allocate(units, budget)
    assert caught.value.exit_code == 2
    assert "\n" not in str(caught.value)


def test_size_helpers_check_their_input_too() -> None:
    with pytest.raises(InputError, match="no format options"):
        smallest_bytes([Unit("g0", ())])
    with pytest.raises(InputError, match="no layer groups"):
        largest_useful_bytes([])
    units = [unit("a", ("gptq-int4", 10, 0.5), ("smoothquant-w8a8", 20, 0.0), ("16-bit", 40, 0.0))]
    assert (smallest_bytes(units), largest_useful_bytes(units)) == (10, 20)
