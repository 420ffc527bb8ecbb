"""Mixed-precision allocation: one format per layer group, least predicted damage within a size.

Each unit (a layer group of `quantize.fusion`) has a few options, one per candidate format
("gptq-int4", "smoothquant-w8a8", "16-bit"), each with the exact number of bytes the group
takes in that format and a predicted cost (a sensitivity score in nats, additive over groups,
>= 0). `allocate` picks one option per unit so that the summed cost is least and the summed
bytes are at most the budget: a multiple-choice knapsack.

It is solved as a 0/1 integer program (a binary x[u, o] per option, one option per unit,
bytes . x <= budget, minimise cost . x) by HiGHS through `scipy.optimize.milp`, a well-kept
branch-and-bound solver, not by a hand-written dynamic programme: a DP over bytes needs the
byte counts rounded onto a grid (a billion-byte budget has no exact table), and rounding
either breaks the budget or gives away room; the integer program takes the byte counts as
they are. HiGHS works in floating point, though, and accepts a row that is over its bound by
about a millionth of the row's largest coefficient (measured: 1 byte over with 2.7 MB steps,
1000 bytes over with 2.7 GB steps, however the row is scaled). So every answer is checked in
integers, and one over the budget is solved again with the bound lowered by that tolerance:
the budget is never exceeded, and allocations within a millionth of the largest size step of
the budget's edge may be passed over for the next best. With size steps under about a million
bytes the answer is the exact optimum (the tests compare it with brute force).

Ties: allocations whose costs differ by at most TIE_TOLERANCE of the largest option cost are
tied, and the one with the fewest bytes wins. This is a second, lexicographic solve: first the
least cost C, then the fewest bytes subject to cost <= C + TIE_TOLERANCE / 2 (the other half is
left for HiGHS's own tolerance); its answer is taken only if it checks out, in exact sums, as
within TIE_TOLERANCE of C and no larger, else the first answer stands. Options that another
option of the same unit matches or beats on both counts are dropped before solving (of two
identical ones, the first is kept). Between allocations equal in cost and in bytes, the answer
is whichever HiGHS returns: the same one for the same input.
"""

from __future__ import annotations

# scipy (and numpy with it) is imported where used: scipy.optimize and scipy.sparse take a third
# of a second to import, and only an allocation needs them, not every importer of this module.
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from quantgate.core.errors import InputError

# Two allocations whose costs differ by at most this share of the largest option cost (of the
# options left once dominated ones are dropped) are tied: ten times HiGHS's own tolerance on a
# row, far below any difference a sensitivity score resolves.
TIE_TOLERANCE = 1e-5
# The objectives' largest coefficient: HiGHS stops at an absolute gap of 1e-6, here a billionth
# of the largest cost (or of the largest size step, in the second solve).
_OBJECTIVE_SCALE = 1e3
# HiGHS's tolerance on a row, as a share of its largest coefficient (mip_feasibility_tolerance;
# it scales each row itself): after a choice over the budget, the bound is lowered by at least
# this share of the largest size step, and by at least twice the overshoot, doubling each time.
_ROW_TOLERANCE = 1e-6
_MAX_RESOLVES = 40  # a bound for the doubling; one re-solve is the rule


@dataclass(frozen=True)
class Option:
    format: str  # "gptq-int4", "smoothquant-w8a8", "16-bit"
    bytes: int  # the unit's exact size in this format
    cost: float  # predicted damage, nats, >= 0 (0 for 16-bit)


@dataclass(frozen=True)
class Unit:
    name: str  # the layer group's name
    options: tuple[Option, ...]  # one per candidate format


class AllocationJSON(TypedDict):
    """An allocation as a search trial records it (`Allocation.to_json`, read by `from_json`)."""

    budget: int
    bytes: int
    cost: float
    choice: dict[str, str]  # unit name -> format, in unit order


@dataclass(frozen=True)
class Allocation:
    choice: dict[str, str]  # unit name -> format, in unit order
    bytes: int  # the chosen options' bytes, summed (units only)
    cost: float  # the chosen options' costs, summed
    budget: int

    def by_format(self) -> dict[str, list[str]]:
        """Format -> the units given it, in unit order; formats in order of first use."""
        found: dict[str, list[str]] = {}
        for name, format_ in self.choice.items():
            found.setdefault(format_, []).append(name)
        return found

    def to_json(self) -> AllocationJSON:
        return {"budget": self.budget, "bytes": self.bytes, "cost": self.cost, "choice": dict(self.choice)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Allocation:
        try:
            choice = {str(name): str(format_) for name, format_ in dict(data["choice"]).items()}
            return cls(choice=choice, bytes=int(data["bytes"]), cost=float(data["cost"]), budget=int(data["budget"]))
        except (KeyError, TypeError, ValueError) as error:
            raise InputError(f"not an allocation: {error!r}") from None


def _check_option(unit: str, option: Option) -> None:
    where = f"layer group {unit}, format {option.format}"
    if not isinstance(option.bytes, int) or isinstance(option.bytes, bool) or option.bytes < 0:
        raise InputError(f"{where}: size must be a whole number of bytes >= 0, got {option.bytes!r}")
    if not isinstance(option.cost, (int, float)) or not math.isfinite(option.cost) or option.cost < 0:
        raise InputError(f"{where}: cost must be a finite number >= 0, got {option.cost!r}")


def _check_units(units: Sequence[Unit]) -> None:
    if not units:
        raise InputError("no layer groups to allocate")
    names: set[str] = set()
    for unit in units:
        if unit.name in names:
            raise InputError(f"duplicate layer group name {unit.name}")
        names.add(unit.name)
        if not unit.options:
            raise InputError(f"layer group {unit.name} has no format options")
        formats: set[str] = set()
        for option in unit.options:
            if option.format in formats:
                raise InputError(f"layer group {unit.name} lists format {option.format} twice (duplicate format)")
            formats.add(option.format)
            _check_option(unit.name, option)


def smallest_bytes(units: Sequence[Unit]) -> int:
    """The bytes with every unit at its smallest option: the least budget `allocate` takes."""
    _check_units(units)
    return sum(min(option.bytes for option in unit.options) for unit in units)


def largest_useful_bytes(units: Sequence[Unit]) -> int:
    """The bytes with every unit at its lowest-cost option (ties: fewer bytes): a larger budget
    buys nothing more."""
    _check_units(units)
    return sum(min(unit.options, key=lambda option: (option.cost, option.bytes)).bytes for unit in units)


def _undominated(unit: Unit) -> tuple[Option, ...]:
    """The unit's options that no other beats on both counts; of identical ones, the first."""
    kept: list[Option] = []
    for option in sorted(unit.options, key=lambda option: (option.bytes, option.cost)):
        if not kept or option.cost < kept[-1].cost:
            kept.append(option)
    return tuple(kept)


@dataclass(frozen=True)
class _Problem:
    """The kept options, flattened: variable j is option `options[j]` of unit `unit_of[j]`."""

    options: tuple[Option, ...]
    unit_of: tuple[int, ...]
    units: int
    extra: tuple[int, ...]  # bytes over the unit's smallest option

    @classmethod
    def of(cls, units: Sequence[Unit]) -> _Problem:
        options: list[Option] = []
        unit_of: list[int] = []
        extra: list[int] = []
        for index, unit in enumerate(units):
            kept = _undominated(unit)
            options.extend(kept)
            unit_of.extend([index] * len(kept))
            extra.extend(option.bytes - kept[0].bytes for option in kept)
        return cls(tuple(options), tuple(unit_of), len(units), tuple(extra))

    def scaled(self, values: Sequence[float]) -> list[float]:
        """`values` with the largest at _OBJECTIVE_SCALE (all zero stays all zero)."""
        top = max(values, default=0.0)
        return [value / top * _OBJECTIVE_SCALE if top > 0 else 0.0 for value in values]

    def extra_bytes(self, picked: Sequence[int]) -> int:
        return sum(self.extra[variable] for variable in picked)

    def cost(self, picked: Sequence[int]) -> float:
        return math.fsum(self.options[variable].cost for variable in picked)


_Row = tuple[Sequence[float], float]  # coefficients, upper bound


def _milp_pick(problem: _Problem, objective: Sequence[float], rows: Sequence[_Row]) -> list[int] | None:
    """The variables HiGHS sets to 1, one per unit, minimising `objective` subject to one option
    per unit and each row; None if HiGHS finds the rows infeasible."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    count = len(problem.options)
    pick_one = csr_array((np.ones(count), (np.array(problem.unit_of), np.arange(count))), shape=(problem.units, count))
    constraints = [LinearConstraint(pick_one, lb=1.0, ub=1.0)]
    constraints += [LinearConstraint(np.array([coefficients]), ub=bound) for coefficients, bound in rows]
    result = milp(np.array(objective, dtype=float), integrality=np.ones(count), bounds=Bounds(0.0, 1.0),
                  constraints=constraints, options={"mip_rel_gap": 0.0})
    if result.status == 2:  # infeasible
        return None
    if result.status != 0 or result.x is None:
        raise RuntimeError(f"HiGHS found no allocation: {result.message}")
    chosen: dict[int, int] = {}
    for variable in range(count):  # the largest x of each unit: robust to x = 0.9999999
        unit = problem.unit_of[variable]
        if unit not in chosen or result.x[variable] > result.x[chosen[unit]]:
            chosen[unit] = variable
    return [chosen[unit] for unit in range(problem.units)]


def _pick_within(problem: _Problem, objective: Sequence[float], room: int,
                 cost_row: _Row | None = None) -> list[int] | None:
    """`_milp_pick` with at most `room` bytes over the smallest options, checked in integers. A
    choice over it is solved again with the bound lowered by HiGHS's tolerance, or by twice what
    it let through. None if HiGHS finds nothing, or once the lowering would take the whole room."""
    step = max(problem.extra) / _OBJECTIVE_SCALE  # bytes per unit of the scaled row
    bytes_row = [more / step for more in problem.extra]
    margin = 0
    for _ in range(_MAX_RESOLVES):
        if margin and margin >= room:
            break
        bound = room - margin
        picked = _milp_pick(problem, objective, [(bytes_row, bound / step)] + ([cost_row] if cost_row else []))
        if picked is None or problem.extra_bytes(picked) <= room:
            return picked
        margin = max(2 * max(margin, problem.extra_bytes(picked) - bound), math.ceil(_ROW_TOLERANCE * max(problem.extra)))
    return None


def _fewest_bytes_at_least_cost(problem: _Problem, room: int) -> list[int]:
    """Solve for the least cost, then for the fewest bytes among allocations as cheap to within
    TIE_TOLERANCE; the second answer only if it checks out as no dearer and no larger. Should
    HiGHS's tolerance be as large as the whole room, every unit gets its smallest option."""
    costs = [option.cost for option in problem.options]
    cost_objective = problem.scaled(costs)
    cheapest = _pick_within(problem, cost_objective, room)
    if cheapest is None:
        return [variable for variable, more in enumerate(problem.extra) if more == 0]
    if problem.extra_bytes(cheapest) == 0:  # nothing is smaller
        return cheapest
    # Some unit has two options left, so its smallest costs more than 0: max(costs) > 0.
    cap = math.fsum(cost_objective[variable] for variable in cheapest) + TIE_TOLERANCE / 2 * _OBJECTIVE_SCALE
    smallest = _pick_within(problem, problem.scaled([float(more) for more in problem.extra]), room, (cost_objective, cap))
    if smallest is None:
        return cheapest
    tied = problem.cost(smallest) <= problem.cost(cheapest) + TIE_TOLERANCE * max(costs)
    return smallest if tied and problem.extra_bytes(smallest) <= problem.extra_bytes(cheapest) else cheapest


def allocate(units: Sequence[Unit], budget: int) -> Allocation:
    """One format per unit with the least summed cost whose summed bytes are at most `budget`;
    of allocations tied in cost (to within TIE_TOLERANCE of the largest option cost), the one
    with the fewest bytes. InputError for unusable units or a budget below `smallest_bytes`."""
    floor = smallest_bytes(units)  # checks the units
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise InputError(f"the budget must be a whole number of bytes, got {budget!r}")
    if budget < floor:
        raise InputError(f"budget of {budget} bytes is below the smallest allocation, {floor} bytes "
                         "(every group at its smallest format)")
    problem = _Problem.of(units)
    if all(more == 0 for more in problem.extra):  # one option left per unit: nothing to choose
        picked = list(range(len(problem.options)))
    else:
        picked = _fewest_bytes_at_least_cost(problem, budget - floor)
    chosen = [problem.options[variable] for variable in picked]
    total = sum(option.bytes for option in chosen)
    if total > budget:  # _pick_within checked it; this is the invariant, said once more
        raise RuntimeError(f"allocation of {total} bytes is over the budget of {budget}")
    return Allocation(choice={unit.name: option.format for unit, option in zip(units, chosen, strict=True)},
                      bytes=total, cost=math.fsum(option.cost for option in chosen), budget=budget)
