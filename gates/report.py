"""The size-vs-accuracy report: one row per format (and the baseline), written as report.json
(the `Report` of gates.report_model, schema_version 2), report.md and a self-contained
report.html (inline SVG, no scripts, no network).

Data first, then render: `compose` works out everything the report says from the run's records
(gates.report_records) once, taking the run's decisions from gates.decisions (which rows may be
deployed, the recommendations, the Pareto front): every sentence,
table cell and figure datum. `markdown` and `html_page` hand that `Report` to the Jinja
templates in gates/templates (HTML autoescaped; the figures from gates.figures), which decide
nothing, so `read` of a report.json renders the same page again.

The page reads top down: the policy (narrowed or not), a summary (what is recommended, one
sentence per blocked format naming the gates that blocked it), a compact table that fits a
1280-pixel window, the size-vs-metric plot with its Pareto front, one section per candidate with
a forest plot of its metric gates, a table of every gate's numbers and reason and a table of its
per-token KL tails, then what was measured: each set's looks and ceiling, and the items each
format was evaluated on (the baseline's results hold each set's first look only).

A run with a mixed-precision search (search.json) adds its trials as rows beside the formats,
each with its verdict on the search split (the items that selected it: "passed the search split",
never "approved"), and the chosen trial's held-out gate as a row of its own (`<trial>@held-out`),
the only verdict that can approve a mixed checkpoint; the plot draws the trials as diamonds and
rings the held-out-approved checkpoint; a search section gives the conclusion, the trials and the
held-out items, and a per-layer sensitivity chart (sensitivity/sensitivity.json)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TypeGuard

from quantgate.core.artifacts import atomic_directory, read_json, sha256_json
from quantgate.core.errors import InputError
from quantgate.core.ids import GateId, SetRef
from quantgate.core.metrics import METRICS
from quantgate.core.validation import validated
from quantgate.evalsets.served import FAILED
from quantgate.gates import figures
from quantgate.gates.decisions import decode_rate, deployable, measured_recommendation, pareto_front, recommendation, search_role
from quantgate.gates.report_model import (
    HELD_OUT,
    READABLE_VERSIONS,
    TRIAL,
    AllocationStrip,
    AsServed,
    Candidate,
    EvalSet,
    ForestFigure,
    ForestRow,
    FormatRow,
    FormatsTable,
    FrontPoint,
    GateRecord,
    GateRow,
    HeldOutMark,
    MeasuredChoice,
    MeasuredSection,
    PlotFigure,
    PlotPoint,
    Policy,
    RecommendationList,
    Report,
    Row,
    RowRecord,
    RunFacts,
    RunRecords,
    SearchSection,
    SensitivityFigure,
    SensitivityPoint,
    SensitivitySection,
    SeriesLegend,
    Serving,
    ServingRow,
    ServingSection,
    StabilityBar,
    StabilityFigure,
    StabilitySection,
    Summary,
    TailCell,
    TailRow,
    TailsSection,
    TrialRow,
)
from quantgate.gates.report_records import column_higher_is_better, records
from quantgate.gates.stats import STABILITY_BAR
from quantgate.gates.templating import ENVIRONMENT
from quantgate.gates.verdict import PENDING

# A gate's outcome as a verdict record writes it (gates.policy.Outcome's values: the report
# renders stored records, so it reads the strings rather than the policy module).
PASS, FAIL, INSUFFICIENT, NOT_EVALUATED = "pass", "fail", "insufficient evidence", "not evaluated"
BLOCKING = (FAIL, INSUFFICIENT)  # the outcomes that decided a block (not evaluated only follows one)

# Which way the size and integrity checks are better (metric gates read it from the metrics table).
_EXACT_HIGHER_IS_BETTER = {"bits_per_weight": False, "unexplained_bytes": False, "finite_logits": True,
                           "loads": True, "calibration_overlap": False}


# ---- a row's verdict ------------------------------------------------------------------------------

def verdict_text(row: RowRecord) -> str:
    """'approved', 'pending serving', 'blocked', 'baseline'; a trial's 'passed the search split'
    (', serving pending') or 'blocked on the search split'; the held-out gate's 'approved on
    held-out items' (', serving pending') or 'blocked on held-out items'."""
    role, verdict = search_role(row), row.verdict
    pending = ", serving pending" if verdict == PENDING else ""
    if role == TRIAL:
        return f"passed the search split{pending}" if verdict in ("approved", PENDING) else "blocked on the search split"
    if role == HELD_OUT:
        return f"approved on held-out items{pending}" if verdict in ("approved", PENDING) else "blocked on held-out items"
    return "pending serving" if verdict == PENDING else verdict


def row_class(row: RowRecord) -> str:
    """The row's class in the formats table, its badge's: the verdict ('approved', 'blocked',
    'baseline'); a trial 'trial passed' or 'trial blocked' (never 'approved'); a held-out gate
    'held-out approved' or 'held-out blocked'."""
    role = search_role(row)
    if role == TRIAL:
        return "trial passed" if row.verdict in ("approved", PENDING) else "trial blocked"
    return f"held-out {row.verdict}" if role == HELD_OUT else row.verdict


def class_lines(row: RowRecord) -> list[str]:
    """Per device class the row's serving verdict: 'cpu-avx512 (AVX-512, no AMX): approved: ...'."""
    lines = []
    for device_class, entry in row.classes.items():
        line = f"{device_class}: {entry.status}: {entry.reason}"
        if entry.next:
            line += f"; to attest it where it will serve: {entry.next}"
        lines.append(line + "".join(f"; {as_served_text(gated)}" for gated in entry.as_served))
    return lines


def as_served_text(gated: AsServed) -> str:
    """'as vLLM's default serves it (VLLM_CPU_INT4_W4A8=1: W4A16 as W4A8), its golden sets passed: lambada acc ...'."""
    settings = ", ".join(f"{key}={value}" for key, value in gated.settings.items()) or "no settings"
    schemes = ", ".join(f"{asked} as {computed}" for asked, computed in gated.served_as.items())
    how = "as the engine's default serves it" if gated.numerics == "engine_default" else "as the serve stage served it"
    outcome = {"passed": "its golden sets pass", "failed": "its golden sets fail"}.get(str(gated.status), "not evaluated")
    return f"{how} ({settings}{': ' + schemes if schemes else ''}), {outcome}: {gated.reason}"


def pending_sentence(row: RowRecord) -> str:
    """Why a format whose quality passed is not approved yet, and what to run next."""
    lines = class_lines(row) or [f"no serving evidence: {'; '.join(row.reasons) or 'none recorded'}"]
    return f"{display_name(row)} passes every quality gate and is pending serving: {' '.join(lines)}"


def engine_default_sentence(row: RowRecord) -> str | None:
    """Where the engine's default would serve another scheme than was gated (INT4 as W4A8 on an AMX
    CPU): what it would serve and how far that is from the gated numerics."""
    serving = row.serving
    default = serving.engine_default if serving is not None else None
    if serving is None or default is None:
        return None
    schemes = ", ".join(f"{gated} as {served}" for gated, served in default.served_as.items())
    settings = ", ".join(f"{key}={value}" for key, value in serving.engine_settings.items())
    head = (f"{display_name(row)}: vLLM's defaults on {serving.device_class} would serve {schemes}; the serve stage "
            f"served it as gated ({settings})")
    agreement = default.agreement
    if agreement is None:
        return f"{head}; the default could not be measured: {default.reason or 'no record'}."
    nll = f", NLL {agreement.nll_change:+.4f} nats a token" if agreement.nll_change is not None else ""
    return (f"{head}. Under the default, served log-probs differ from gated by {agreement.mean_abs_logprob_difference:.3f} nats "
            f"a token (mean; p99 {agreement.p99_abs_logprob_difference:.3f}){nll}.")


def mix_text(groups_by_format: dict[str, int]) -> str:
    """'mixed: 59 groups gptq-int4, 61 smoothquant-w8a8'."""
    parts = [f"{count} {'group' if count == 1 else 'groups'} {fmt}" if index == 0 else f"{count} {fmt}"
             for index, (fmt, count) in enumerate(groups_by_format.items())]
    return "mixed: " + ", ".join(parts) if parts else "mixed"


def display_name(row: RowRecord) -> str:
    """A row's name in a sentence: the format, or 'search-2 on held-out items' for a held-out gate."""
    if row.search is not None and row.search.role == HELD_OUT:
        return f"{row.search.checkpoint} on held-out items"
    return row.format


def long_name(row: RowRecord) -> str:
    """A search row with its mix: 'search-2 (mixed: 59 groups gptq-int4, 61 smoothquant-w8a8)'."""
    if row.search is None:
        return row.format
    return f"{display_name(row)} ({mix_text(row.search.groups_by_format)})"


def with_rules(row: RowRecord) -> Row:
    """The row with the rules' outcomes, worked out once for every renderer."""
    return Row(**dict(row), deployable=deployable(row), verdict_text=verdict_text(row), display_name=display_name(row),
               long_name=long_name(row), row_class=row_class(row), class_lines=class_lines(row))


# ---- the recommendations --------------------------------------------------------------------------

def measured_choice(rows: Sequence[RowRecord]) -> MeasuredChoice | None:
    """gates.decisions' measured recommendation, with each row by its display name."""
    decided = measured_recommendation(rows)
    if decided is None:
        return None
    best = decided.best
    return MeasuredChoice(format=None if best is None else display_name(best),
                          tokens_per_s=None if best is None else decode_rate(best),
                          baseline_tokens_per_s=decided.baseline_tokens_per_s,
                          slower_than_baseline=[display_name(row) for row in decided.slower_than_baseline], device=decided.device)


def measured_sentence(choice: MeasuredChoice | None) -> str | None:
    """The recommendation for the machine the serve stage measured, from measured decode rates."""
    if choice is None:
        return None
    where = f"this machine ({choice.device or '?'}, vLLM, measured)"
    base = choice.baseline_tokens_per_s
    base_text = f"; the 16-bit baseline decodes at {base:.1f} tokens/s there" if base is not None else ""
    if choice.format is None or choice.tokens_per_s is None:
        return f"On {where}: no approved format was served{base_text}."
    sentence = f"On {where}: {choice.format}, the approved format vLLM decodes fastest at batch 1 ({choice.tokens_per_s:.1f} tokens/s){base_text}."
    slower = choice.slower_than_baseline
    if slower:
        sentence += (f" {', '.join(slower)} {'decodes' if len(slower) == 1 else 'decode'} slower than the baseline here: "
                     "fewer bytes do not pay where the kernels, not memory, bound a step.")
    return sentence


def recommendation_sentences(data: RunRecords) -> list[str]:
    """Per hardware profile, the recommended format and why, one sentence each."""
    rows = {row.format: row for row in data.rows}
    sentences = []
    for profile in data.hardware:
        choice = recommendation(data.rows, profile.name)
        if choice is None:
            sentences.append(f"On {profile.name}: no format is approved, so none is recommended.")
            continue
        row = rows[choice]
        bound = row.bounds[profile.name]
        size = f", {row.ratio_to_baseline:.2f}x the baseline's bytes" if row.ratio_to_baseline is not None else ""
        what = choice
        if row.search is not None and row.search.role == HELD_OUT:  # the search's checkpoint, by the verdict that approved it
            trial = row.search.checkpoint
            what = (f"{trial} ({mix_text(row.search.groups_by_format)}), the mixed checkpoint "
                    f"checkpoints/{trial} approved on held-out items")
        sentences.append(f"On {profile.name}: {what}, the approved format with the lowest batch-1 decode bound "
                         f"({bound.batch1_ms:.3f} ms a step, a lower bound{size}).")
    return sentences


def recommendation_list(data: RunRecords) -> RecommendationList:
    """report.md's recommendation section: per profile the choice (a mixed checkpoint with its checkpoint)."""
    rows = {row.format: row for row in data.rows}
    lines = []
    for profile in data.hardware:
        choice = recommendation(data.rows, profile.name)
        row = rows.get(choice or "")
        shown = choice
        if row is not None and row.search is not None:
            shown = f"{choice} ({verdict_text(row)}: checkpoints/{row.search.checkpoint})"
        lines.append(f"{profile.name}: {shown or 'none (no format approved)'}")
    mixed = " (a mixed checkpoint by its held-out verdict only)" if data.search is not None else ""
    return RecommendationList(intro=f"The approved format with the lowest batch-1 decode bound on each hardware profile{mixed}:",
                              lines=lines)


# ---- numbers in words -------------------------------------------------------------------------------

def _number(value: float | int | str | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def policy_label(policy: Policy) -> str:
    """'small-model@v2', or 'small-model@v2 narrowed to arc-easy, wiki-text (dropped: hellaswag)'
    for a policy the plan narrowed (its identity's `narrowed_to` and `dropped`)."""
    label = f"{policy.name}@{policy.version}"
    if policy.narrowed_to is None:
        return label
    label += f" narrowed to {', '.join(policy.narrowed_to)}"
    return label + (f" (dropped: {', '.join(policy.dropped)})" if policy.dropped else "")


def _set_name(spec: str) -> str:
    """'wiki-text' for 'wiki-text@v1' (a spec this version cannot parse: as it is)."""
    try:
        return SetRef.parse(spec).name
    except InputError:
        return spec


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _amount(value: float | None, unit: str, signed: bool = True, limit: bool = False) -> str:
    """A gate's number in its unit: changes (points, percent) signed to two decimals, bytes whole,
    bits to four decimals, a bare value (KL, an agreement, a share) to three significant digits
    kept (0.100, so an interval's ends line up), a bare limit as the policy wrote it (0.15)."""
    if value is None:
        return "–"
    if not math.isfinite(value):
        return str(value)
    if unit in ("points", "%"):
        return f"{value:+.2f}" if signed else f"{value:.2f}"
    if unit == "bytes":
        return f"{value:,.0f}"
    if unit == "bits":
        return f"{value:+.4f}" if signed else f"{value:.4f}"
    if abs(value) >= 100:
        return f"{value:,.1f}"
    return f"{value:g}" if limit else f"{value:#.3g}"


def _suffix(unit: str, short: bool = False) -> str:
    if unit == "points":
        return " pts" if short else " points"
    return unit if unit in ("%", "") else f" {unit}"


# ---- a gate's numbers -------------------------------------------------------------------------

def _gate_id(gate: GateRecord) -> GateId | None:
    try:
        return GateId.parse(gate.gate)
    except InputError:
        return None


def _on_golden_set(gate: GateRecord) -> bool:
    gate_id = _gate_id(gate)
    return gate_id is not None and gate_id.on_golden_set


def _label(gate: GateRecord) -> str:
    """'wiki-text kl_divergence': the set without its version, as the gates' reasons name it."""
    gate_id = _gate_id(gate)
    if gate_id is None:
        return gate.gate
    try:
        scope = SetRef.parse(gate_id.scope).name if gate_id.on_golden_set else gate_id.scope
    except InputError:
        scope = gate_id.scope
    return f"{scope} {gate_id.check}"


def _higher_is_better(gate: GateRecord) -> bool:
    """Which way a gate's number is better: the metrics table for metric gates, a fixed table for
    size and integrity checks; for a gate this version does not know, what its outcome implies
    (a pass above its limit means higher is better), else lower (a divergence, a change)."""
    gate_id = _gate_id(gate)
    if gate_id is not None:
        known = METRICS.get(gate_id.check) if gate_id.on_golden_set else None
        if known is not None:
            return known.higher_is_better
        if not gate_id.on_golden_set and gate_id.check in _EXACT_HIGHER_IS_BETTER:
            return _EXACT_HIGHER_IS_BETTER[gate_id.check]
    estimate, limit = gate.estimate, gate.limit
    if _finite(estimate) and _finite(limit) and estimate != limit and gate.outcome in (PASS, FAIL):
        return (estimate > limit) == (gate.outcome == PASS)
    return False


def _limit_text(gate: GateRecord, short: bool = True) -> str:
    relation = "≥" if _higher_is_better(gate) else "≤"
    return f"{relation} {_amount(gate.limit, gate.unit, limit=True)}{_suffix(gate.unit, short)}"


def _exact(gate: GateRecord) -> bool:
    """A size or integrity check: one exact number, no interval."""
    return gate.decided_by == "exact" or not _on_golden_set(gate)


def _interval_text(gate: GateRecord) -> str:
    if _exact(gate) or gate.low is None or gate.high is None:
        return "–"
    return f"[{_amount(gate.low, gate.unit)}, {_amount(gate.high, gate.unit)}]"


def _estimate_text(gate: GateRecord, short: bool = True) -> str:
    if gate.estimate is None:
        return "–"
    return f"{_amount(gate.estimate, gate.unit)}{_suffix(gate.unit, short)}"


def _look_text(gate: GateRecord) -> str:
    text = f"{gate.look} of {gate.looks}" if gate.look is not None and gate.looks is not None else "–"
    return f"{text}, by {gate.decided_by}" if gate.decided_by in ("interval", "ceiling") else text


def _confidence_text(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.3g}%"


def _spread_text(gate: GateRecord, value: float | None) -> str:
    if value is None:
        return "–"
    return f"{_amount(value, gate.unit, signed=False)}{_suffix(gate.unit, short=True)}"


def _counts(row: RowRecord) -> tuple[int, int, int]:
    """(gates in all, gates that blocked: failed or insufficient evidence, gates not evaluated)."""
    return (len(row.gates), sum(gate.outcome in BLOCKING for gate in row.gates),
            sum(gate.outcome == NOT_EVALUATED for gate in row.gates))


def _gate_items(row: RowRecord) -> dict[str, int]:
    """Set spec -> the most items any of its decided gates saw (a verdict record without
    `sequential`: the only count it holds)."""
    per_set: dict[str, int] = {}
    for gate in row.gates:
        gate_id = _gate_id(gate)
        if gate_id is not None and gate_id.on_golden_set and gate.items is not None:
            per_set[gate_id.scope] = max(per_set.get(gate_id.scope, 0), gate.items)
    return per_set


def depths(row: RowRecord) -> dict[str, int] | None:
    """Set spec -> items the format was evaluated on (0: not run), as its looks went
    (the verdict's `sequential.items`); None for a record without them."""
    return None if row.sequential is None or row.sequential.items is None else dict(row.sequential.items)


def items_evaluated(row: RowRecord) -> int | None:
    """Items a format was evaluated on, over its golden sets: its looks' depths where the
    verdict records them, else (an older record) each set once, at the most items any of its
    decided gates saw."""
    per_set = depths(row)
    if per_set is None:
        per_set = _gate_items(row)
    return sum(per_set.values()) if per_set else None


def _items_parts(per_set: dict[str, int]) -> list[str]:
    """['wiki-text 25', 'lambada 240', 'arc-easy 0']."""
    return [f"{_set_name(spec)} {count:,}" for spec, count in per_set.items()]


def baseline_depths(data: RunRecords) -> dict[str, int] | None:
    """Set spec -> items the baseline was evaluated on: each set's first look (its own values),
    and as deep as any format went (paired with it, item by item); None when no row records
    its looks."""
    # a held-out gate's items are after the plan's: not the baseline's first N
    paired = (depths(row) for row in data.rows if row.verdict != "baseline" and search_role(row) != HELD_OUT)
    recorded = [per_set for per_set in paired if per_set is not None]
    if not recorded:
        return None
    result = {entry.spec: entry.items for entry in data.evalsets}
    for per_set in recorded:
        for spec, count in per_set.items():
            result[spec] = max(result.get(spec, 0), count)
    return result


def split_offsets(row: RowRecord) -> dict[str, int]:
    """Set spec -> the items a search row's split skips (a held-out gate: the plan's items); {} otherwise."""
    return {spec: entry.offset for spec, entry in row.search.split_items.items()} if row.search is not None else {}


def split_items_text(row: RowRecord) -> str:
    """'lambada items 5–8, wiki-text items 5–8': the items of each set a search row was judged on
    (from its split's offsets and its looks' depths, else the split's ceiling)."""
    if row.search is None:
        return ""
    per_set = depths(row) or {}
    parts = []
    for spec, entry in row.search.split_items.items():
        count = per_set.get(spec, entry.ceiling)
        parts.append(f"{_set_name(spec)} items {entry.offset + 1:,}–{entry.offset + count:,}" if count else f"{_set_name(spec)} not run")
    return ", ".join(parts)


def _verdict_note(row: RowRecord) -> str:
    """'blocked by 2 of 9 gates, 4 not evaluated' / 'all 9 gates passed'."""
    total, blocking, skipped = _counts(row)
    if row.verdict == "baseline":
        return ""
    if not total:
        reasons = len(row.reasons)
        return f"{reasons} reason{'s' if reasons != 1 else ''}" if reasons else ""
    if row.verdict == "approved":
        return f"all {total} gates passed" if blocking + skipped == 0 else f"{total - blocking - skipped} of {total} gates passed"
    note = f"{blocking} of {total} gates failed"
    return note + (f", {skipped} not evaluated" if skipped else "")


# ---- the summary ------------------------------------------------------------------------------

def _decided(gate: GateRecord) -> str:
    """', decided after 25 items (look 1 of 3)': how much evidence settled a metric gate."""
    if _exact(gate) or gate.items is None:
        return ""
    text = f", decided after {gate.items} items"
    if (gate.looks or 1) > 1 and gate.look is not None:
        text += f" (look {gate.look} of {gate.looks})"
    return text


def _gate_phrase(gate: GateRecord) -> str:
    """One blocking gate in a sentence: its numbers against its limit (without `_decided`)."""
    if _exact(gate) or not _finite(gate.estimate):
        return gate.reason or f"{_label(gate)} {gate.outcome}"
    unit = gate.unit
    observed = f"{_label(gate)} {_amount(gate.estimate, unit)}{_suffix(unit)} {_interval_text(gate)}"
    limit = _amount(gate.limit, unit, limit=True) + _suffix(unit)
    if gate.outcome == FAIL:
        return f"{observed} {'below' if _higher_is_better(gate) else 'above'} {limit}"
    return f"{observed}, insufficient evidence against the limit {limit}"


def _join(phrases: list[str]) -> str:
    # the phrases hold commas of their own, so semicolons separate them
    return phrases[0] if len(phrases) == 1 else "; ".join(phrases[:-1]) + "; and " + phrases[-1]


def blocked_sentence(row: RowRecord) -> str:
    """Why a blocked format is blocked, in one sentence naming the gates that decided it."""
    if not row.gates:  # a verdict record from before gates were recorded one by one
        return f"{display_name(row)} is blocked" + (f": {'; '.join(row.reasons)}." if row.reasons else ".")
    blocking = [gate for gate in row.gates if gate.outcome in BLOCKING]
    skipped = [gate for gate in row.gates if gate.outcome == NOT_EVALUATED]
    if not blocking:
        return (f"{display_name(row)} is blocked: {len(skipped)} gate{'s were' if len(skipped) != 1 else ' was'} "
                f"not evaluated ({', '.join(_label(gate) for gate in skipped)}).")
    decided = {_decided(gate) for gate in blocking}
    if len(decided) == 1:  # one look settled them all (the usual case): say how once
        joined = _join([_gate_phrase(gate) for gate in blocking]) + decided.pop()
    else:
        joined = _join([_gate_phrase(gate) + _decided(gate) for gate in blocking])
    tail = f"; {len(skipped)} more gate{'s were' if len(skipped) != 1 else ' was'} not evaluated after that" if skipped else ""
    return f"{display_name(row)} is blocked by {joined}{tail}."


def approved_sentence(data: RunRecords) -> str:
    """The approved formats (and the search's checkpoint, approved on held-out items); a trial
    that passed the search split only is not among them (`search_sentences` names it)."""
    approved = [display_name(row) for row in data.rows if deployable(row)]
    candidates = [row for row in data.rows if row.verdict != "baseline" and search_role(row) != TRIAL]
    pending = [row for row in candidates if row.verdict == PENDING]
    if not approved:
        if pending:
            return (f"No format is approved yet: {len(pending)} of {len(candidates)} pass every quality gate and are pending "
                    f"serving ({', '.join(display_name(row) for row in pending)}), the rest are blocked.")
        return f"No format is approved: all {len(candidates)} are blocked."
    listed = approved[0] if len(approved) == 1 else ", ".join(approved[:-1]) + " and " + approved[-1]
    return f"Approved, every gate passed: {listed} ({len(approved)} of {len(candidates)} formats)."


def search_sentences(data: RunRecords) -> list[str]:
    """The search's conclusion, and the trials that passed the search split only (not approved
    for release); none without a search."""
    search = data.search
    if search is None:
        return []
    sentences = [f"Mixed-precision search: {(search.conclusion or 'no conclusion recorded').rstrip('.')}."]
    approved_held_out = search.held_out is not None and search.held_out.verdict == "approved"
    passed = [row.format for row in data.rows if search_role(row) == TRIAL and row.verdict == "approved"
              and not (approved_held_out and row.format == search.chosen)]
    if passed:
        listed = passed[0] if len(passed) == 1 else ", ".join(passed[:-1]) + " and " + passed[-1]
        verb = "passed" if len(passed) == 1 else "each passed"
        sentences.append(f"{listed} {verb} the search split only, so {'it is not' if len(passed) == 1 else 'none is'} approved for release: "
                         "a trial's own verdict was reached on the items that selected it, and only the held-out gate "
                         "can approve a mixed checkpoint.")
    return sentences


def policy_line(data: RunFacts) -> str:
    """The page's header line: the policy, narrowed or not, and its hash."""
    return (f"Policy {policy_label(data.policy)}; sha256 {data.policy.sha256[:12]}. "
            "Decode times are lower bounds from peak bandwidth and FLOP/s, not measurements.")


def narrowed_sentence(data: RunFacts) -> str | None:
    """For a narrowed policy, what its verdicts do not cover; None for a whole policy."""
    policy = data.policy
    if policy.narrowed_to is None:
        return None
    sentence = f"Gated under policy {policy_label(policy)}"
    if not policy.dropped:
        return sentence + "."
    them = "it" if len(policy.dropped) == 1 else "them"
    return sentence + f": no gate on {', '.join(policy.dropped)} was applied, so no verdict here speaks for {them}."


def serving_class_sentences(data: RunRecords) -> list[str]:
    """Per served checkpoint, the device class and kernels it was served with, and where the
    engine's default would have served another scheme, what and how far from gated."""
    sentences = []
    for row in data.rows:
        serving = row.serving
        if serving is None or not serving.device_class:
            continue
        served_as = ", ".join(f"{entry.scheme} as {entry.served_as}" for entry in serving.schemes)
        kernels = "; ".join(serving.kernels) or "no kernel line in its log"
        name = display_name(row) if row.verdict != "baseline" else "baseline"
        sentences.append(f"{name} on {serving.device_class}: {served_as or 'unquantized'} (kernels: {kernels}).")
        # the scheme read from the kernel vLLM logged disagrees with what serving.device.RULES expect
        sentences += [f"{name} on {serving.device_class}: kernel evidence against the table: {entry.mismatch}."
                      for entry in serving.schemes if entry.mismatch]
        if serving.engine_default is not None and serving.engine_default.mismatch:
            sentences.append(f"{name} on {serving.device_class}, under the engine's defaults: kernel evidence against the table: "
                             f"{serving.engine_default.mismatch}.")
        default = engine_default_sentence(row)
        if default:
            sentences.append(default)
        for device_class, entry in row.classes.items():
            sentences += [f"{name} on {device_class}, {as_served_text(gated)}." for gated in entry.as_served]
    return sentences


def engine_default_sentences(data: RunRecords) -> list[str]:
    """Those of `serving_class_sentences` that say the engine's default would serve other numerics."""
    served = [row for row in data.rows if row.serving is not None and row.serving.device_class]
    return [sentence for row in served if (sentence := engine_default_sentence(row)) is not None]


def summary(data: RunRecords) -> Summary:
    """The summary's sentences: the recommendations, what is approved, the search's conclusion, a
    narrowed policy, each blocked or pending format (a trial blocked on the search split is the
    bisection at work, not a finding), each served checkpoint's device class."""
    candidates = [row for row in data.rows if search_role(row) != TRIAL]
    return Summary(recommendations=recommendation_sentences(data), measured=measured_sentence(measured_choice(data.rows)),
                   approved=approved_sentence(data), search=search_sentences(data), narrowed=narrowed_sentence(data),
                   blocked=[blocked_sentence(row) for row in candidates if row.verdict == "blocked"],
                   pending=[pending_sentence(row) for row in candidates if row.verdict == PENDING],
                   serving_classes=serving_class_sentences(data),
                   engine_defaults=engine_default_sentences(data))


# ---- served in vLLM ---------------------------------------------------------------------------

SERVING_HEADER = ["checkpoint", "served", "|logprob diff| mean / p99 (bound)", "KL served‖gated", "top-1", "greedy identical",
                  "tokens/s b1 (bound)", "tokens/s b8 (bound)"]


def _serving_bound(row: RowRecord, check: str) -> str:
    gate = next((gate for gate in row.gates if gate.gate == f"serving {check}"), None)
    return f"{gate.limit:.3f}" if gate is not None and _finite(gate.limit) and gate.outcome != NOT_EVALUATED else "–"


def _rate(serving: Serving, batch: str) -> str:
    entry = serving.throughput.get(batch)
    return "–" if entry is None else f"{entry.tokens_per_s:.1f} ({entry.bound_tokens_per_s:,.0f})"


def _served_row(row: RowRecord, serving: Serving) -> ServingRow:
    name = display_name(row) if row.verdict != "baseline" else "baseline"
    if not serving.served:
        pending = serving.status in (PENDING, FAILED)
        return ServingRow(cells=[name, f"{'pending' if pending else 'no'}: {serving.reason or '?'}", *["–"] * 6], failed=not pending)
    agreement, greedy = serving.agreement, serving.greedy
    if agreement is not None:
        bounds = [_serving_bound(row, "mean_logprob_difference"), _serving_bound(row, "p99_logprob_difference")]
        bound = f" ({' / '.join(bounds)})" if row.verdict != "baseline" and bounds != ["–", "–"] else ""
        cells = [f"{agreement.mean_abs_logprob_difference:.3f} / {agreement.p99_abs_logprob_difference:.3f}{bound}",
                 _number(agreement.kl_served_gated_mean, 4), _number(agreement.top1_agreement, 3)]
    else:
        cells = ["not measured", "–", "–"]
    greedy_cell = f"{greedy.identical} of {greedy.prompts}" if greedy is not None else "–"
    return ServingRow(cells=[name, f"yes ({serving.dtype})", *cells, greedy_cell, _rate(serving, "1"), _rate(serving, "8")],
                      failed=False)


def serving_note(data: RunRecords) -> str:
    """What the serving table's numbers are."""
    served = [row.serving for row in data.rows if row.serving is not None]
    measured = [serving.bandwidth_bytes_per_s / 1e9 for serving in served if serving.bandwidth_bytes_per_s]
    engine = next((serving.engine for serving in served if serving.engine is not None), None)
    which = f"vLLM {engine.version} ({engine.engine})" if engine else "vLLM"
    span = f"{min(measured):.1f}" if measured and max(measured) - min(measured) < 0.05 else \
        f"{min(measured):.1f}-{max(measured):.1f}" if measured else ""
    at = f" at the copy bandwidth each checkpoint's worker measured ({span} GB/s)" if measured else ""
    return (f"Each checkpoint served by {which} and compared with the evaluation its gate saw, token by token on the same "
            "token ids: |served - gated| log-probability of each token (nats; the bounds in brackets are the serving gate's: "
            "the baseline's own difference plus the policy's margin), KL(served‖gated) from the served top-k, top-1 agreement, "
            "greedy continuations identical to the gated model's. Decode tokens/s are measured on the machine the run used "
            f"(median of runs); the bound in brackets reads every stored byte once a step{at}, an upper bound.")


def serving_section(data: RunRecords) -> ServingSection | None:
    """Per checkpoint the serve stage checked (the baseline, the formats, a search's trials and its
    held-out gate): served or not, the agreement with what was gated against the serving gate's
    bounds, greedy continuations, measured decode tokens/s against the bound at the measured copy
    bandwidth; None where nothing was served."""
    rows = [_served_row(row, row.serving) for row in data.rows if row.serving is not None]
    return ServingSection(note=serving_note(data), header=SERVING_HEADER, rows=rows) if rows else None


# ---- the search ---------------------------------------------------------------------------------

SEARCH_HEADER = ["trial", "budget (x baseline)", "bytes (x baseline)", "predicted cost", "groups per format",
                 "verdict on the search split", "first reason"]


def conclusion_sentence(data: RunRecords) -> str:
    """The search's conclusion (gates.search.conclusion) as a sentence of its own: capitalised
    unless it starts with a name ('search-2 (0.399x ...'), with its full stop."""
    text = ((data.search.conclusion if data.search is not None else None) or "no conclusion recorded").rstrip(".")
    first = text.split(" ", 1)[0]
    return (text[0].upper() + text[1:] if first.isalpha() else text) + "."


def _ratio(value: float | None) -> str:
    return f"{value:.3f}" if _finite(value) else "–"


def search_table(data: RunRecords) -> list[TrialRow]:
    """One row per trial (SEARCH_HEADER): its byte budget and stored bytes as ratios to the
    baseline's tensor bytes, the allocation's predicted cost, its groups per format, its verdict
    on the search split and the first reason; the chosen trial marked."""
    if data.search is None:
        return []
    rows = []
    for trial in data.search.trials:
        name = trial.name + (" (chosen)" if trial.name == data.search.chosen else "")
        groups = ", ".join(f"{fmt} {count}" for fmt, count in trial.groups_by_format.items())
        passed = trial.verdict == "approved"
        cost = trial.predicted_cost
        cells = [name, _ratio(trial.budget_ratio), _ratio(trial.ratio), f"{cost:.3g}" if _finite(cost) else "–", groups or "–",
                 "passed the search split" if passed else "blocked on the search split", (trial.reasons or ["–"])[0]]
        rows.append(TrialRow(cells=cells, passed=passed))
    return rows


def held_out_sentence(data: RunRecords) -> str:
    """The search's result: the chosen trial's held-out verdict, on which items, and its reason."""
    search = data.search
    chosen, held = (search.chosen, search.held_out) if search is not None else (None, None)
    if not chosen and (search is None or not search.trials):
        return "No trial ran, so no mixed checkpoint was gated on held-out items."
    if not chosen:
        return "No trial passed the search split, so none was gated on held-out items and no mixed checkpoint is approved."
    if held is None:
        return f"{chosen} passed the search split; its held-out gate has not run, so it is not approved."
    row = next((row for row in data.rows if row.search is not None and row.search.role == HELD_OUT
                and row.search.checkpoint == chosen), None)
    items = f" ({split_items_text(row)})" if row is not None and split_items_text(row) else ""
    if held.verdict == "approved":
        return (f"{chosen}: approved on held-out items{items}, items no trial was judged on; this verdict alone approves "
                f"the mixed checkpoint checkpoints/{chosen}.")
    reasons = held.reasons or ["no reason recorded"]
    more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
    return f"{chosen}: blocked on held-out items{items}: {reasons[0]}{more}."


def search_lines(data: RunRecords) -> list[str]:
    """What the search section says beside its table: the trials' items, the repeats, its settings."""
    if data.search is None:
        return []
    search, lines = data.search, []
    trial = next((row for row in data.rows if search_role(row) == TRIAL), None)
    if trial is not None and split_items_text(trial):
        lines.append(f"Each trial was judged on the search split ({split_items_text(trial)}): the items that selected "
                     "the trial, so a trial's own verdict approves nothing.")
    if search.repeats:
        same = sorted({str(entry.same_as) for entry in search.repeats})
        many = len(search.repeats) != 1
        lines.append(f"{len(search.repeats)} budget{'s' if many else ''} gave the allocation of an earlier trial "
                     f"({', '.join(same)}), whose verdict stood for {'them' if many else 'it'}: not quantized again.")
    else:
        lines.append("No budget repeated an earlier trial's allocation (0 repeats).")
    space = search.space
    baseline = space.baseline_bytes
    bounds = ""
    if baseline and search.lo_bytes is not None and search.ceiling_bytes is not None:
        bounds = (f"; budgets between {search.lo_bytes / baseline:.3f}x (the smallest format it mixes) and "
                  f"{search.ceiling_bytes / baseline:.3f}x the baseline's tensor bytes")
    lines.append(f"Objective {search.objective or '?'}, at most {_or_unknown(search.max_trials)} trials, mixing "
                 f"{', '.join(search.formats)} over {_or_unknown(space.groups)} layer groups{bounds}. "
                 "The predicted cost is the allocation's summed sensitivity score.")
    return lines


def _or_unknown(value: int | None) -> str:
    return "?" if value is None else str(value)


def _allocation(data: RunRecords) -> AllocationStrip | None:
    """The chosen trial's name and its group -> format, for the sensitivity chart's strip."""
    if data.search is None:
        return None
    trial = next((entry for entry in data.search.trials if entry.name == data.search.chosen), None)
    if trial is None or trial.allocation is None:
        return None
    return AllocationStrip(trial=trial.name, choice=trial.allocation.choice)


def sensitivity_caption(data: RunRecords) -> str:
    """What the sensitivity chart shows: the method and its formula, the unit, the calibration
    tokens, the log scale, the strip, and the rank check where the artifact holds one."""
    sensitivity = data.sensitivity
    assert sensitivity is not None
    tokens = f" from {sensitivity.tokens:,} calibration tokens" if sensitivity.tokens is not None else ""
    fisher = f", {sensitivity.fisher} Fisher" if sensitivity.fisher else ""
    formula = f" ({sensitivity.formula})" if sensitivity.formula else ""
    text = (f"Per-layer-group sensitivity by {sensitivity.method or 'an unnamed method'}{formula}, in "
            f"{sensitivity.unit or 'its own unit'}{tokens}{fisher}: one point per layer group and format, on a log scale "
            "(a zero score is a hollow point on the floor).")
    allocation = _allocation(data)
    if allocation:
        text += f" The strip under the axis: the format {allocation.trial} gave each group (grey: left at 16 bits)."
    spearman = {fmt: rho for fmt, rho in sensitivity.spearman.items() if _finite(rho)}
    if spearman:
        text += (" Rank correlation (Spearman) of the per-block sums with the KL measured by quantizing each block alone: "
                 + ", ".join(f"{fmt} {rho:.2f}" for fmt, rho in spearman.items()) + ".")
    return text


def sensitivity_table(data: RunRecords) -> tuple[list[str], list[list[str]]]:
    """The chart's numbers: one row per layer group, a score per format (and the chosen trial's choice)."""
    sensitivity = data.sensitivity
    assert sensitivity is not None
    allocation = _allocation(data)
    header = ["#", "layer group", "block", *sensitivity.formats] + ([allocation.trial] if allocation else [])
    rows = []
    for index, group in enumerate(sensitivity.groups):
        cells = [str(index), group.name, _number(group.block)]
        cells += [f"{group.scores[fmt]:.3g}" if _finite(group.scores.get(fmt)) else "–" for fmt in sensitivity.formats]
        if allocation:
            cells.append(allocation.choice.get(group.name, "–"))
        rows.append(cells)
    return header, rows


def sensitivity_figure(data: RunRecords) -> SensitivityFigure:
    """The chart's data: a series per format (its total in the legend), each group's scores (a
    score the record lacks is 0, drawn on the floor), and the chosen trial's strip."""
    sensitivity = data.sensitivity
    assert sensitivity is not None
    formats = sensitivity.formats
    series = []
    for fmt in formats:
        total = sensitivity.totals.get(fmt)
        series.append(SeriesLegend(format=fmt, label=fmt + (f" (total {total:.3g})" if _finite(total) else "")))
    groups = [SensitivityPoint(name=group.name, block=group.block, scores={fmt: float(group.scores.get(fmt, 0.0)) for fmt in formats})
              for group in sensitivity.groups]
    unit = sensitivity.unit or "score"
    return SensitivityFigure(axis=f"{unit.split(' (')[0]}, log scale", series=series, groups=groups, allocation=_allocation(data))


def search_section(data: RunRecords) -> SearchSection | None:
    """The search: its conclusion, the held-out verdict and its items, the trials, the repeats,
    and the per-layer sensitivity chart; None without a search."""
    if data.search is None:
        return None
    sensitivity = None
    if data.sensitivity is not None:
        header, rows = sensitivity_table(data)
        sensitivity = SensitivitySection(caption=sensitivity_caption(data), header=header, rows=rows, figure=sensitivity_figure(data))
    held = data.search.held_out
    return SearchSection(conclusion=conclusion_sentence(data), held_out=held_out_sentence(data),
                         held_out_approved=held is not None and held.verdict == "approved", lines=search_lines(data),
                         header=SEARCH_HEADER, trials=search_table(data), sensitivity=sensitivity)


# ---- the main table ---------------------------------------------------------------------------

def _baseline_items(data: RunRecords) -> list[str]:
    per_set = baseline_depths(data)
    if per_set is not None:
        return _items_parts(per_set)
    return [_number(sum(entry.items for entry in data.evalsets) or None)]


def _row_items(row: RowRecord) -> list[str]:
    """Per set as the looks went; an older record: the items of its decided gates, summed."""
    per_set = depths(row)
    return _items_parts(per_set) if per_set is not None else [_number(items_evaluated(row))]


def formats_table(data: RunRecords) -> FormatsTable:
    """The compact table: one row per format, few columns (the gates' numbers are in each
    candidate's section), so that it fits a 1280-pixel window."""
    profiles = [profile.name for profile in data.hardware]
    header = ["format", "MB", "x baseline", "bits/weight"] + [f"{p} b1 ms" for p in profiles] + ["KL", "verdict", "items"]
    baseline_items = _baseline_items(data)
    rows = []
    for row in data.rows:
        bits = row.bits_per_weight_layers
        if bits is None:
            bits = row.bits_per_parameter  # the baseline: no quantized layers, its dtype's bits
        numbers = [_number(None if row.bytes is None else row.bytes / 1e6, 1), _number(row.ratio_to_baseline, 2), _number(bits, 2)]
        numbers += [f"{row.bounds[p].batch1_ms:.3f}" if p in row.bounds else "–" for p in profiles]
        numbers.append(_number(row.kl_divergence, 4))
        baseline = row.verdict == "baseline"
        rows.append(FormatRow(format=row.format, link=not baseline,
                              mix=mix_text(row.search.groups_by_format) if row.search is not None else None,
                              long_name=long_name(row), numbers=numbers, verdict=verdict_text(row), note=_verdict_note(row),
                              items=baseline_items if baseline else _row_items(row), row_class=row_class(row)))
    return FormatsTable(header=header, rows=rows)


# ---- a candidate's details --------------------------------------------------------------------

GATE_HEADER = ["gate", "outcome", "estimate", "interval", "limit", "items", "look", "confidence",
               "± half-width", "detectable", "stability", "reason"]


def gate_cells(gate: GateRecord) -> list[str]:
    """One row of a candidate's gate table (GATE_HEADER)."""
    return [gate.gate, gate.outcome, _estimate_text(gate), _interval_text(gate), _limit_text(gate), _number(gate.items),
            _look_text(gate), _confidence_text(gate.confidence), _spread_text(gate, gate.half_width),
            _spread_text(gate, gate.detectable), stability_text(gate), gate.reason]


def facts_sentence(row: RowRecord, profiles: list[str]) -> str:
    """A format's size and decode bounds (batch 1 and 32) in one sentence."""
    parts = []
    if row.bytes is not None:
        ratio = row.ratio_to_baseline
        relative = f" ({ratio:.2f}x the baseline)" if ratio is not None and row.verdict != "baseline" else ""
        parts.append(f"{row.bytes / 1e6:.1f} MB{relative}")
    if row.bits_per_weight_layers is not None:
        parts.append(f"{row.bits_per_weight_layers:.2f} bits per weight in the quantized layers")
    if row.bits_per_parameter is not None:
        parts.append(f"{row.bits_per_parameter:.2f} bits per parameter over the whole model")
    bounds = [f"{p} {row.bounds[p].batch1_ms:.3f} / {row.bounds[p].batch32_ms:.3f} ms" for p in profiles if p in row.bounds]
    text = "; ".join(parts) if parts else "not measured"
    if bounds:
        text += f". Decode-step lower bounds at batch 1 / 32: {', '.join(bounds)}"
    return text + "."


def _forest_row(gate: GateRecord) -> ForestRow:
    """A metric gate as the forest plot draws it: how far past the limit each number is, turned so
    that the worse side is positive (the gates are in different units, so each row gets its own
    scale in the figure); nothing to draw for a gate not evaluated."""
    evaluated = gate.outcome != NOT_EVALUATED
    sign = -1.0 if _higher_is_better(gate) else 1.0

    def past_limit(value: float | None) -> float | None:
        return sign * (value - gate.limit) if evaluated and _finite(value) and _finite(gate.limit) else None

    numbers = f"{_estimate_text(gate)} {_interval_text(gate)}".replace(" –", "") if evaluated else "–"
    return ForestRow(label=_label(gate), outcome=gate.outcome, reason=gate.reason, low=past_limit(gate.low),
                     estimate=past_limit(gate.estimate), high=past_limit(gate.high), numbers=numbers, limit=_limit_text(gate))


def forest_figure(row: RowRecord) -> ForestFigure:
    """Every metric gate of a candidate as one row of its forest plot (size and integrity checks
    are exact numbers: in the table, not the plot)."""
    return ForestFigure(format=row.format, rows=[_forest_row(gate) for gate in row.gates if _on_golden_set(gate)])


def _gate_rows(row: RowRecord) -> list[GateRow]:
    return [GateRow(cells=gate_cells(gate), outcome=gate.outcome) for gate in row.gates]


def search_note(row: RowRecord) -> str | None:
    """A search row's candidate section: what judged it, and what its verdict can and cannot do."""
    info = row.search
    if info is None:
        return None
    mix = mix_text(info.groups_by_format)
    items = split_items_text(row)
    on = f" ({items})" if items else ""
    if info.role == HELD_OUT:
        return (f"The search's result: {info.checkpoint}'s mixed checkpoint ({mix}) gated once more, on held-out items no "
                f"trial was judged on{on}. This verdict, and no trial's, can approve the mixed checkpoint.")
    chosen = " The search chose it: its held-out gate is the search's result." if info.chosen else ""
    return (f"A search trial ({mix}), judged on the search split{on}, the items that selected it: passing its gates there "
            f"does not approve it for release.{chosen}")


def candidate(row: RowRecord, profiles: list[str]) -> Candidate:
    return Candidate(format=row.format, row_class=row_class(row), verdict_text=verdict_text(row), facts=facts_sentence(row, profiles),
                     search_note=search_note(row), blocked=blocked_sentence(row) if row.verdict == "blocked" else None,
                     forest=forest_figure(row), gate_header=GATE_HEADER, gates=_gate_rows(row),
                     reasons=[] if row.gates else row.reasons, stability=stability_section(row), tails=tails_section(row),
                     not_evaluated=[f"{spec}: {why}" for spec, why in row.not_evaluated.items()])


# ---- a candidate's verdict stability ------------------------------------------------------------

# A decided metric gate is flagged unstable below this share of its items' resamples deciding the
# same (gates.stats.STABILITY_BAR).
_DECIDED = (PASS, FAIL, INSUFFICIENT)


def _stable_gates(row: RowRecord) -> list[GateRecord]:
    """The row's decided metric gates that carry a stability (verdicts from before it carry none)."""
    return [gate for gate in row.gates if _on_golden_set(gate) and gate.outcome in _DECIDED and _finite(gate.stability)]


def _stability(gate: GateRecord) -> float:
    assert gate.stability is not None  # a gate of _stable_gates
    return gate.stability


def stability_text(gate: GateRecord) -> str:
    """A gate's stability cell: the share to two decimals, 'exact' for a size, integrity or
    serving check (one exact number: no resample changes it), '–' where none was computed."""
    if _exact(gate) and gate.outcome != NOT_EVALUATED:
        return "exact"
    return f"{gate.stability:.2f}" if _finite(gate.stability) else "–"


def unstable_gates(row: RowRecord) -> list[GateRecord]:
    """The decided metric gates whose stability is below STABILITY_BAR."""
    return [gate for gate in _stable_gates(row) if _stability(gate) < STABILITY_BAR]


def stability_lines(row: RowRecord) -> list[str]:
    """One line per unstable gate, or one saying every decided gate is stable; none when no gate
    carries a stability."""
    stable = _stable_gates(row)
    if not stable:
        return []
    lines = [f"{_label(gate)} ({gate.outcome}) is unstable: a resample of its items decides otherwise in "
             f"{100 * (1 - _stability(gate)):.0f}% of cases (stability {_stability(gate):.2f} over "
             f"{gate.stability_resamples or '?'} resamples)" for gate in unstable_gates(row)]
    return lines or [f"Every decided metric gate is stable: at least {STABILITY_BAR:.0%} of the resamples of its items "
                     f"decide as it did (lowest {min(_stability(gate) for gate in stable):.2f})."]


def stability_section(row: RowRecord) -> StabilitySection | None:
    """A candidate's verdict stability: a bar per decided metric gate (0 to 1, the bar at 0.9
    marked; a bar below it is red and says so) and the lines flagging the unstable gates."""
    lines = stability_lines(row)
    if not lines:
        return None
    bars = [StabilityBar(label=_label(gate), share=_stability(gate), unstable=_stability(gate) < STABILITY_BAR)
            for gate in _stable_gates(row)]
    return StabilitySection(lines=lines, unstable=bool(unstable_gates(row)),
                            figure=StabilityFigure(format=row.format, bar=STABILITY_BAR, rows=bars))


# ---- a candidate's tails ------------------------------------------------------------------------

# The tails a verdict records for each text set (gates.verdict.TAIL_METRICS), as the table heads them.
TAIL_COLUMNS = (("kl_divergence", "mean KL"), ("kl_median", "median"), ("kl_p90", "p90"), ("kl_p99", "p99"),
                ("kl_p999", "p99.9"), ("kl_max", "max KL"), ("top_prob_change_mean", "mean Δp"),
                ("top_prob_change_p01", "p01 Δp"))
TAIL_HEADER = ["set", *(title for _, title in TAIL_COLUMNS)]


def tail_rows(row: RowRecord) -> list[TailRow]:
    """Per text set: its name, the items, and per TAIL_COLUMNS the value and '[low, high]', three
    significant digits ('–' for a tail the record lacks)."""
    result = []
    for spec, metrics in row.tails.items():
        if not metrics:
            continue
        cells, items = [], None
        for name, _ in TAIL_COLUMNS:
            entry = metrics.get(name)
            if entry is None:
                cells.append(TailCell(value="–", interval=""))
                continue
            items = items if items is not None else entry.items
            interval = f"[{_amount(entry.low, '')}, {_amount(entry.high, '')}]" if _finite(entry.low) and _finite(entry.high) else ""
            cells.append(TailCell(value=_amount(entry.estimate, "") if entry.estimate is not None else "–", interval=interval))
        result.append(TailRow(set=_set_name(spec), items=None if items is None else f"{items:,} items", cells=cells))
    return result


def tails_note(row: RowRecord) -> str:
    """What the tails table shows, and which of the tails a gate judged (those are in the forest
    plot as well)."""
    confidences = {entry.confidence for metrics in row.tails.values() for entry in metrics.values() if entry.confidence is not None}
    level = f"{_confidence_text(confidences.pop())} " if len(confidences) == 1 else ""
    names = {name for name, _ in TAIL_COLUMNS}
    gated = [_label(gate) for gate in row.gates
             if (gate_id := _gate_id(gate)) is not None and gate_id.on_golden_set and gate_id.check in names]
    which = (f"the gated ones ({', '.join(gated)}) are in the forest plot as well" if gated
             else "none is gated here (a gated one is in the forest plot as well)")
    return ("The per-token KL divergence from the baseline (nats) over each text set's evaluated items, and Δp, the change "
            "in the probability of the baseline's top token (negative: the format gives it less), each with its "
            f"{level}bootstrap interval over items, gated or not: {which}.")


def tails_section(row: RowRecord) -> TailsSection | None:
    rows = tail_rows(row)
    return TailsSection(note=tails_note(row), header=TAIL_HEADER, rows=rows) if rows else None


# ---- what was measured ----------------------------------------------------------------------------

def _looks(entry: EvalSet) -> list[int]:
    """A golden set's looks (item counts, the last its ceiling); a report of a run from before
    looks: one look, at the items it evaluated."""
    return list(entry.looks) or [entry.items]


def _measured_cell(row: RowRecord, spec: str, looks: list[int]) -> str:
    """The items `row` was evaluated on in one set, with the look that was."""
    per_set = depths(row)
    if per_set is None:
        items = _gate_items(row).get(spec)
        return "–" if items is None else f"{items:,}"
    if not per_set.get(spec):
        return "not run"
    items, offset = per_set[spec], split_offsets(row).get(spec)
    if offset:  # held out: the items after the plan's
        return f"{items:,} held out (items {offset + 1:,}–{offset + items:,})"
    look = f" (look {looks.index(items) + 1} of {len(looks)})" if items in looks and len(looks) > 1 else ""
    return f"{items:,}{look}"


def measured_table(data: RunRecords) -> tuple[list[str], list[list[str]]]:
    """Per golden set: its looks, its ceiling, and per format the items it was evaluated on
    (with the look that was), 'not run' where its looks never reached the set."""
    candidates = [row for row in data.rows if row.verdict != "baseline"]
    header = ["golden set", "looks at (items)", "ceiling", *(row.format for row in candidates)]
    rows = []
    for entry in data.evalsets:
        looks = _looks(entry)
        size = entry.size
        ceiling = f"{looks[-1]:,}" + (" (whole set)" if size == looks[-1] else f" of {size:,}" if size else "")
        rows.append([entry.spec, ", ".join(f"{items:,}" for items in looks), ceiling,
                     *(_measured_cell(row, entry.spec, looks) for row in candidates)])
    return header, rows


def context_lines(data: RunRecords) -> list[str]:
    """The sizes behind the numbers: how many items each golden set contributed, the
    confidence level, the calibration set, the bounds' assumptions, the baseline's own numbers."""
    lines = []
    if data.evalsets:
        lines.append(f"Golden sets: {', '.join(entry.spec for entry in data.evalsets)}, each looked at on its first N items "
                     "for each N in its looks, the last its ceiling. A format's looks at a set stop at the look that decides all "
                     "its gates there, or once another gate has blocked the format (fail fast): the table below gives, per set, "
                     "the looks and the items each format was evaluated on.")
        lines.append(f"Differences are format minus baseline, item by item on the items the format was evaluated on, with "
                     f"{data.confidence:.0%} paired-bootstrap intervals (a set looked at more than once "
                     "has each look's interval at a higher confidence; each gate's is in its candidate's table).")
    if data.calibration is not None:
        calibration = data.calibration
        lines.append(f"Calibration set: {calibration.samples} x {calibration.seq_len} tokens from {calibration.source} "
                     f"(fingerprint {calibration.fingerprint[:12]}).")
    if data.bounds_inputs is not None:
        inputs = data.bounds_inputs
        lines.append(f"Decode bounds: batch 1 and 32, {inputs.context_tokens} context tokens a sequence, "
                     f"{inputs.kv_bytes_per_element:g}-byte KV cache, peak bandwidth and FLOP/s of each profile.")
    baseline = next((row for row in data.rows if row.verdict == "baseline"), None)
    if baseline is not None:
        values = [f"{column} {entry.value:.4f}" for column, entry in baseline.metrics.items() if _finite(entry.value)]
        profiles = [profile.name for profile in data.hardware]
        first = ", ".join(f"{_set_name(entry.spec)} {entry.items:,}" for entry in data.evalsets)
        at = f" Its values, at each set's first look ({first} items)" if first else " Its values"
        lines.append(f"Baseline: {facts_sentence(baseline, profiles)}" + (f"{at}: {', '.join(values)}." if values else ""))
    return lines


def measured_section(data: RunRecords) -> MeasuredSection:
    header, rows = measured_table(data)
    return MeasuredSection(lines=context_lines(data), header=header, rows=rows)


# ---- the size-vs-metric plot ----------------------------------------------------------------------

def _plot_higher_is_better(data: RunRecords) -> bool:
    if data.plot.higher_is_better is not None:
        return data.plot.higher_is_better
    return column_higher_is_better(data.plot.y) if data.plot.y else False


def _plotted(data: RunRecords) -> list[tuple[RowRecord, float, float]]:
    """(row, MB, value) for the baseline, each format and each search trial with a size and a
    value of the plot's metric. A held-out gate is no point of its own: it judged the chosen
    trial's checkpoint, whose point is ringed."""
    points = []
    for row in data.rows:
        entry = row.metrics.get(data.plot.y or "")
        value = entry.value if entry is not None else None
        if search_role(row) != HELD_OUT and row.bytes is not None and value is not None:
            points.append((row, row.bytes / 1e6, value))
    return points


def plot_front(data: RunRecords) -> list[tuple[float, float, str]]:
    """The Pareto front of the plot's points (baseline, formats, trials): the smallest checkpoint
    for each best value of the plot's metric, in order of size."""
    return pareto_front([(mb, value, row.format) for row, mb, value in _plotted(data)], _plot_higher_is_better(data))


def _held_out_mark(data: RunRecords) -> HeldOutMark | None:
    """The chosen trial and its held-out verdict, where the search gated one on held-out items."""
    search = data.search
    if search is None or not search.chosen or search.held_out is None or not search.held_out.verdict:
        return None
    return HeldOutMark(checkpoint=search.chosen, approved=search.held_out.verdict == "approved")


PLOT_NOTE = ("The search's trials are purple diamonds (filled: passed the search split; hollow: blocked on it), their values "
             "on the search split; the checkpoint approved on held-out items is ringed in green (blocked there: a dashed red "
             "ring). The Pareto front is the step line through the points no other point beats: no larger and no worse.")


def plot_figure(data: RunRecords) -> PlotFigure:
    """Size against the plot's metric: each format, the baseline and each search trial, the
    Pareto front, the checkpoint the search's held-out gate judged."""
    front = plot_front(data)
    on_front = {label for _, _, label in front}
    points = [PlotPoint(mb=mb, value=value, label=row.format, verdict=row.verdict, trial=search_role(row) == TRIAL,
                        front=row.format in on_front) for row, mb, value in _plotted(data)]
    return PlotFigure(metric=data.plot.y or "metric", points=points,
                      front=[FrontPoint(mb=mb, value=value, label=label) for mb, value, label in front],
                      held_out=_held_out_mark(data), trials=any(point.trial for point in points),
                      note=PLOT_NOTE if data.search is not None else None)


# ---- the report -----------------------------------------------------------------------------------

def compose(data: RunRecords) -> Report:
    """Everything the report says of a run's records, worked out once."""
    profiles = [profile.name for profile in data.hardware]
    facts = {name: getattr(data, name) for name in RunFacts.model_fields}
    return Report(
        **facts,
        rows=[with_rules(row) for row in data.rows],
        recommendation={profile: recommendation(data.rows, profile) for profile in profiles},
        measured_recommendation=measured_choice(data.rows),
        policy_line=policy_line(data),
        summary=summary(data),
        formats=formats_table(data),
        recommendations=recommendation_list(data),
        figure=plot_figure(data),
        search_section=search_section(data),
        serving_section=serving_section(data),
        candidates=[candidate(row, profiles) for row in data.rows if row.verdict != "baseline"],
        measured=measured_section(data),
    )


def build(run_dir: Path) -> Report:
    """The report of a run directory (`quantgate run`, `quantgate report RUN_DIR`)."""
    return compose(records(run_dir))


def data_key(report: Report) -> str:
    """The hash of what a report says, its own key aside: the runner writes the report again only when it changes."""
    return sha256_json(report.model_dump(mode="json", exclude={"key"}))


def read(path: Path) -> Report:
    """A report.json as `write` wrote it; a document of another schema version, or one that does
    not validate, is refused in one line naming the file."""
    data = read_json(path)
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version not in READABLE_VERSIONS:
        readable = ", ".join(str(known) for known in READABLE_VERSIONS)
        raise InputError(f"{path}: report schema_version {version} is not one this version of quantgate reads ({readable}); "
                         "write the report again from its run directory (quantgate report RUN_DIR)")
    return validated(Report, data, f"{path}: not a quantgate report")


def write(report: Report, out: Path, overwrite: bool = True) -> Path:
    """Write report.json, report.md and report.html into `out` atomically."""
    dumped = report.model_dump(mode="json")
    # the version first, where a reader looks for it; the rest in the model's order
    document = json.dumps({"schema_version": dumped.pop("schema_version"), **dumped}, indent=2, ensure_ascii=False) + "\n"
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        (staging / "report.json").write_text(document, encoding="utf-8")
        (staging / "report.md").write_text(markdown(report), encoding="utf-8")
        (staging / "report.html").write_text(html_page(report), encoding="utf-8")
    return Path(out)


def markdown(report: Report) -> str:
    """report.md: the report in Markdown (no plots)."""
    return ENVIRONMENT.get_template("report.md.j2").render(report=report)


def html_page(report: Report) -> str:
    """report.html: one self-contained page, its figures inline SVG (gates.figures)."""
    return ENVIRONMENT.get_template("report.html.j2").render(report=report, figures=figures)
