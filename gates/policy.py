"""Gate policies: versioned YAML (`gates/policies/<name>/v<N>.yaml`), validated on load, and
the decision rule that turns a point estimate and its interval into pass, fail or
insufficient evidence. The rule compares unrounded numbers; rounding is for display only."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from quantgate.core.artifacts import read_yaml, sha256_file
from quantgate.core.errors import InputError, did_you_mean
from quantgate.core.formats import PRECISION_CLASSES, PrecisionClass, precision_class
from quantgate.core.ids import SetRef
from quantgate.core.validation import Strict, is_path, validated

POLICY_DIR = Path(__file__).parent / "policies"
BOUNDS = ("max_drop_points", "max_increase_percent", "max_value", "min_value")

PerClass = dict[str, float]


# The margin's spellings before it was one field, each read only on gates of its kind (another
# kind read `undecided_margin`). Policy files are hashed as they are (every verdict records the
# sha256), so the versions that spell it so stay as written and are read through `_one_margin`.
PER_UNIT_MARGINS = {"undecided_margin_points": "max_drop_points", "undecided_margin_percent": "max_increase_percent"}


class MetricGate(Strict):
    """Exactly one kind of bound per metric, each given per precision class."""

    max_drop_points: PerClass | None = None  # accuracy: candidate may lose at most this many points
    max_increase_percent: PerClass | None = None  # perplexity: relative increase, in percent
    max_value: PerClass | None = None  # KL divergence
    min_value: PerClass | None = None  # top-1 agreement
    # at the last look, how far the interval may reach past the bound on the failing side and
    # still pass (the estimate itself never may), in the bound's own unit: points for
    # max_drop_points, percent for max_increase_percent, the value's unit otherwise
    undecided_margin: float = Field(default=0.0, ge=0)
    # this gate's own minimum: it replaces the policy's sequential.min_items (every gate's) for
    # this gate alone; no verdict (pass or fail) on fewer items
    min_items: int | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _one_margin(cls, value: Any) -> Any:
        """A gate that spells its margin per unit (`undecided_margin_points`, `_percent`: the
        policies of v1) read as it always was: the spelling of the gate's own kind is its margin,
        and what its kind did not read is dropped, as it was (it never decided anything)."""
        if not isinstance(value, dict) or not any(name in value for name in PER_UNIT_MARGINS):
            return value
        kind = next((name for name in BOUNDS if value.get(name) is not None), None)
        own = next((old for old, bound in PER_UNIT_MARGINS.items() if bound == kind), "undecided_margin")
        margin = value.get(own)
        value = {key: item for key, item in value.items() if key not in (*PER_UNIT_MARGINS, "undecided_margin")}
        return value if margin is None else {**value, "undecided_margin": margin}

    @model_validator(mode="after")
    def _one_bound(self) -> MetricGate:
        bounds = [name for name in BOUNDS if getattr(self, name) is not None]
        if len(bounds) != 1:
            raise ValueError(f"give exactly one of {', '.join(BOUNDS)} (got {bounds or 'none'})")
        for precision in getattr(self, bounds[0]):
            if precision not in PRECISION_CLASSES:
                raise ValueError(f"unknown precision class {precision!r}; valid: {', '.join(PRECISION_CLASSES)}")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in BOUNDS if getattr(self, name) is not None)

    def threshold(self, precision: str) -> float:
        values: PerClass = getattr(self, self.kind)
        if precision not in values:
            raise InputError(f"policy gives no {self.kind} for {precision} formats")
        return values[precision]


class Statistics(Strict):
    confidence: float = Field(default=0.95, gt=0, lt=1)
    resamples: int = Field(default=2000, ge=100)
    seed: int = 0
    insufficient_evidence: str = Field(default="block", pattern="^block$")  # fail closed, always


class Sequential(Strict):
    """When to look at the evidence: after the first N items of each set's seeded order, for each
    N in `looks` below the set's ceiling (the plan's limit, or the whole set), and at the ceiling.
    With no looks, a set is evaluated to its ceiling and judged once (a fixed-size test)."""

    looks: tuple[int, ...] = ()
    looks_by_set: dict[str, tuple[int, ...]] = Field(default_factory=dict, description="per golden set (NAME): beats `looks`")
    # the confidence is split evenly over a set's planned looks (docs/gates.md, "Sequential evaluation")
    error_control: str = Field(default="bonferroni", pattern="^bonferroni$")
    # every gate's minimum, unless a gate gives its own `min_items`
    min_items: int = Field(default=1, gt=0, description="no gate is decided on fewer items (a gate's own min_items replaces it)")
    # a gate decided before the set's last look stays open (the next look evaluates more items)
    # unless at least this share of bootstrap resamples of its items decides it the same way
    # (its stability, gates.stats.verdict_stability); 0: the first decision stands. The Bonferroni
    # split holds for any stopping rule, so looking further costs items, not error control.
    min_stability: float = Field(default=0.0, ge=0.0, lt=1.0, description="a decision before the last look needs this stability")

    @field_validator("looks")
    @classmethod
    def _increasing(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        return _increasing_looks(value)

    @field_validator("looks_by_set")
    @classmethod
    def _each_increasing(cls, value: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return {name: _increasing_looks(looks) for name, looks in value.items()}

    def looks_for(self, name: str) -> tuple[int, ...]:
        return self.looks_by_set.get(name, self.looks)


def _increasing_looks(value: tuple[int, ...]) -> tuple[int, ...]:
    if any(n <= 0 for n in value) or list(value) != sorted(set(value)):
        raise ValueError(f"looks must be positive item counts in increasing order, got {list(value)}")
    return value


class SizeGate(Strict):
    max_bits_per_weight_excess: float = Field(default=0.01, ge=0)
    forbid_unexplained_bytes: bool = True


class IntegrityGate(Strict):
    require_finite_logits: bool = True
    max_calibration_overlap: float = Field(default=0.01, ge=0, le=1)


class MixedPrecision(Strict):
    """Which precision class's bounds gate a mixed-precision checkpoint (docs/search.md)."""

    # lowest-bits: the class of the narrowest weights present (INT4 layers anywhere: the 4-bit
    # bounds); highest-bits: the class of the widest (the stricter bounds)
    rule: Literal["lowest-bits", "highest-bits"]


class ByActivations(Strict):
    """A margin for checkpoints whose activations stay 16-bit, and one for those that quantize
    them: with quantized activations, BF16 and FP32 round a few activations to different integer
    steps, so served and gated differ per token by far more than compute alone (docs/serving.md)."""

    weight_only: float = Field(gt=0)
    quantized_activations: float = Field(gt=0)

    def for_record(self, quantized: bool) -> float:
        return self.quantized_activations if quantized else self.weight_only


class ServingGate(Strict):
    """Served as gated (docs/serving.md, "The serving gate"): vLLM loads the checkpoint; its
    log-probabilities of the gated tokens differ from the gated ones (mean and p99 |difference|)
    by no more than the baseline's own served-vs-gated difference (BF16 vLLM against FP32
    transformers: compute alone) plus a margin; and served, it is no worse than gated: its mean
    NLL per token exceeds the gated one by no more than the baseline's own change plus a margin."""

    require_loads: bool = True
    # the baseline's own served-vs-gated mean |difference| at most this: above it, vLLM computes even
    # the 16-bit model otherwise than transformers, and no bound built on it means anything
    max_baseline_mean_logprob_difference: float = Field(gt=0)
    mean_logprob_difference_margin: ByActivations
    p99_logprob_difference_margin: ByActivations
    nll_increase_margin: float = Field(gt=0, description="nats per token over the baseline's own served-vs-gated NLL change")


class Policy(Strict):
    name: str
    version: str = Field(pattern=r"^v\d+$")
    description: str = ""
    statistics: Statistics = Statistics()
    sequential: Sequential = Sequential()
    metrics: dict[str, dict[str, MetricGate]]
    size: SizeGate = SizeGate()
    integrity: IntegrityGate = IntegrityGate()
    # none: the policy gates no mixed-precision checkpoint (a plan with a search is refused)
    mixed_precision: MixedPrecision | None = None
    # none: the policy does not ask that the checkpoint be served (no serve stage decides anything)
    serving: ServingGate | None = None

    @field_validator("metrics")
    @classmethod
    def _versions_that_fit(cls, value: dict[str, dict[str, MetricGate]]) -> dict[str, dict[str, MetricGate]]:
        """A key NAME@vN whose N no integer conversion takes (past Python's 4300 digits) is an
        error here, where it is read; any other key is checked against the golden sets later."""
        for key in value:
            _, at, version = key.partition("@v")
            if at and version.isdigit() and len(version) > 9:  # quantgate.core.ids reads at most 9 digits
                raise ValueError(f"{key[:40]}... ({len(key)} characters): no set version is that long")
        return value


@dataclass(frozen=True)
class LoadedPolicy:
    policy: Policy
    path: Path
    sha256: str
    # a policy narrowed to some of its golden sets (the plan's `narrow_policy`, `gate --narrow-policy`):
    # the sets it still gates and those it no longer does; None when whole
    narrowed_to: tuple[str, ...] | None = None
    dropped: tuple[str, ...] = ()

    @property
    def identity(self) -> dict[str, Any]:
        identity: dict[str, Any] = {"name": self.policy.name, "version": self.policy.version, "sha256": self.sha256}
        if self.narrowed_to is not None:
            identity.update(narrowed_to=list(self.narrowed_to), dropped=list(self.dropped))
        return identity

    @property
    def label(self) -> str:
        """'small-model@v2', or 'small-model@v2 narrowed to arc-easy, wiki-text'."""
        name = f"{self.policy.name}@{self.policy.version}"
        return name if self.narrowed_to is None else f"{name} narrowed to {', '.join(self.narrowed_to)}"

    def narrowed(self, keep: list[str]) -> LoadedPolicy:
        """This policy gating only the sets in `keep` (NAME or NAME@vN, each one it gates);
        the verdicts and the ledger record it as narrowed, with what was dropped."""
        gated = list(self.policy.metrics)
        unknown = [name for name in keep if not any(_matches(name, key) for key in gated)]
        if unknown:
            raise InputError(f"cannot narrow policy {self.policy.name}@{self.policy.version} to {', '.join(unknown)}: "
                             f"it gates {', '.join(gated)}")
        metrics = {key: gates for key, gates in self.policy.metrics.items() if any(_matches(name, key) for name in keep)}
        if not metrics:  # fail closed: a policy narrowed to nothing would approve on size and integrity alone
            raise InputError(f"cannot narrow policy {self.policy.name}@{self.policy.version} to no golden set: "
                             "nothing would be left to gate")
        dropped = tuple(key for key in gated if key not in metrics)
        return LoadedPolicy(self.policy.model_copy(update={"metrics": metrics}), self.path, self.sha256,
                            narrowed_to=tuple(metrics), dropped=dropped)


def _matches(name: str, key: str) -> bool:
    """Whether a set named in a plan (NAME or NAME@vN) is the set a policy key names."""
    try:
        wanted, gated = SetRef.parse(name), SetRef.parse(key)
    except InputError:
        return name == key
    return wanted.name == gated.name and (gated.version is None or wanted.version in (None, gated.version))


def resolve_policy(spec: str | Path) -> Path:
    """A YAML path, or NAME[@vN] of a built-in policy (the newest version when none is given)."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        if not is_path(str(spec)) or not path.is_file():
            raise InputError(f"policy file {_shown(str(path))} does not exist")
        return path
    name, _, version = str(spec).partition("@")
    folder = POLICY_DIR / name
    known = sorted(p.name for p in POLICY_DIR.iterdir() if p.is_dir())
    if name not in known:  # "" or "." would be POLICY_DIR itself, "a/b" a folder below a policy's
        raise InputError(f"unknown policy {_shown(name)!r}{did_you_mean(name, known)}; built in: {', '.join(known)}")
    versions = sorted((p.stem for p in folder.glob("v*.yaml")), key=lambda v: int(v[1:]))
    version = version or versions[-1]
    if version not in versions:
        raise InputError(f"policy {name} has no version {version}; it has {', '.join(versions)}")
    return folder / f"{version}.yaml"


def _shown(text: str) -> str:
    """`text` for a message: its first 80 characters and its length when longer."""
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def load_policy(spec: str | Path, valid_metrics: dict[str, list[str]] | None = None) -> LoadedPolicy:
    """Load and validate a policy. `valid_metrics` maps each known golden set to its metrics;
    a set or metric outside it is an error that lists the valid ones."""
    path = resolve_policy(spec)
    policy = validated(Policy, read_yaml(path, "policy"), f"policy {path}")
    if valid_metrics is not None:
        for set_name, gates in policy.metrics.items():
            base = _set_name(set_name)
            if base not in valid_metrics:
                raise InputError(f"policy {path}: unknown golden set {set_name!r}{did_you_mean(base, list(valid_metrics))}; "
                                 f"valid: {', '.join(sorted(valid_metrics))}")
            for metric in gates:
                if metric not in valid_metrics[base]:
                    raise InputError(f"policy {path}: {set_name} has no metric {metric!r}{did_you_mean(metric, valid_metrics[base])}; "
                                     f"valid: {', '.join(valid_metrics[base])}")
        for name in policy.sequential.looks_by_set:
            if name not in valid_metrics:
                raise InputError(f"policy {path}: sequential.looks_by_set names {name!r}, which is no golden set"
                                 f"{did_you_mean(name, list(valid_metrics))}; valid: {', '.join(sorted(valid_metrics))}")
    return LoadedPolicy(policy, path, sha256_file(path))


def _set_name(key: str) -> str:
    """The golden set a policy's `metrics` key names (`arc-easy@v1` -> `arc-easy`); a key that is
    no set spec at all stays as written, for the 'unknown golden set' message to name it."""
    try:
        return SetRef.parse(key).name
    except InputError:
        return key


class Outcome(str, Enum):
    passed = "pass"
    failed = "fail"
    insufficient = "insufficient evidence"
    not_evaluated = "not evaluated"  # fail fast: another gate blocked the candidate first
    undecided = "undecided"  # at a look before the last: evaluate more items (never in a verdict)


def decide(estimate: float, low: float, high: float, *, limit: float, margin: float, higher_is_better: bool) -> Outcome:
    """Compare the unrounded estimate with `limit`; then ask whether the interval settles it.

    higher_is_better: the value must be >= limit (an accuracy difference >= -max drop, an
    agreement >= its minimum); else the value must be <= limit.
    """
    if higher_is_better:
        if estimate < limit:
            return Outcome.failed
        return Outcome.insufficient if low < limit - margin else Outcome.passed
    if estimate > limit:
        return Outcome.failed
    return Outcome.insufficient if high > limit + margin else Outcome.passed


def mixed_precision_class(policy: LoadedPolicy, bits: set[int]) -> PrecisionClass:
    """The precision class a mixed-precision checkpoint whose quantized layers have the weight
    widths `bits` is gated under, by the policy's `mixed_precision.rule`."""
    rule = policy.policy.mixed_precision
    if rule is None:
        raise InputError(f"policy {policy.label} has no rule for mixed-precision checkpoints: "
                         "add `mixed_precision: {rule: lowest-bits}` (or highest-bits) in a new version of it")
    if not bits:
        raise InputError("a mixed-precision checkpoint with no quantized layer has no precision class")
    chosen = min(bits) if rule.rule == "lowest-bits" else max(bits)
    return precision_class(chosen)
