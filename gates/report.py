"""The size-vs-accuracy report: one row per format (and the baseline), written as
report.json (the data, schema_version 1), report.md and a self-contained report.html (inline
SVG, no scripts, no network).

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

import html
import json
import math
from pathlib import Path
from typing import Any, TypeGuard

from quantgate import evalsets
from quantgate.core.artifacts import MANIFEST, atomic_directory, read_json
from quantgate.core.errors import InputError
from quantgate.core.ids import GateId, SetRef
from quantgate.core.metrics import METRICS
from quantgate.core.rundir import BASELINE, RUN_KIND, RunDir
from quantgate.core.stagecache import stored_value
from quantgate.evalsets.served import FAILED, served_summary
from quantgate.gates.stats import STABILITY_BAR
from quantgate.gates.verdict import PENDING

SCHEMA_VERSION = 1

# A gate's outcome as a verdict record writes it (gates.policy.Outcome's values: the report
# renders stored records, so it reads the strings rather than the policy module).
PASS, FAIL, INSUFFICIENT, NOT_EVALUATED = "pass", "fail", "insufficient evidence", "not evaluated"
BLOCKING = (FAIL, INSUFFICIENT)  # the outcomes that decided a block (not evaluated only follows one)
COLOURS = {PASS: "#1a7f37", FAIL: "#cf222e", INSUFFICIENT: "#bf8700", NOT_EVALUATED: "#8c959f"}

# Which way the size and integrity checks are better (metric gates read it from the metrics table).
_EXACT_HIGHER_IS_BETTER = {"bits_per_weight": False, "unexplained_bytes": False, "finite_logits": True,
                           "loads": True, "calibration_overlap": False}


# A search row's role (its `search.role`): a trial, judged on the search split (its verdict
# approves nothing), or the chosen trial's held-out gate (the search's result).
TRIAL, HELD_OUT = "trial", "held-out"


def search_role(row: dict[str, Any]) -> str | None:
    """TRIAL, HELD_OUT, or None for the baseline and a uniform format."""
    return (row.get("search") or {}).get("role")


def deployable(row: dict[str, Any]) -> bool:
    """Approved by a verdict that can approve it: a format's own, or the search's held-out gate;
    never a trial's verdict on the search split (reached on the items that selected it)."""
    return row["verdict"] == "approved" and search_role(row) != TRIAL


def verdict_text(row: dict[str, Any]) -> str:
    """'approved', 'pending serving', 'blocked', 'baseline'; a trial's 'passed the search split'
    (', serving pending') or 'blocked on the search split'; the held-out gate's 'approved on
    held-out items' (', serving pending') or 'blocked on held-out items'."""
    role, verdict = search_role(row), row["verdict"]
    pending = ", serving pending" if verdict == PENDING else ""
    if role == TRIAL:
        return f"passed the search split{pending}" if verdict in ("approved", PENDING) else "blocked on the search split"
    if role == HELD_OUT:
        return f"approved on held-out items{pending}" if verdict in ("approved", PENDING) else "blocked on held-out items"
    return "pending serving" if verdict == PENDING else str(verdict)




def class_lines(row: dict[str, Any]) -> list[str]:
    """Per device class the row's serving verdict: 'cpu-avx512 (AVX-512, no AMX): approved: ...'."""
    lines = []
    for device_class, entry in (row.get("classes") or {}).items():
        line = f"{device_class}: {entry.get('status')}: {entry.get('reason')}"
        if entry.get("next"):
            line += f"; to attest it where it will serve: {entry['next']}"
        lines.append(line + "".join(f"; {as_served_text(gated)}" for gated in entry.get("as_served") or []))
    return lines


def as_served_text(gated: dict[str, Any]) -> str:
    """'as vLLM's default serves it (VLLM_CPU_INT4_W4A8=1: W4A16 as W4A8), its golden sets passed: lambada acc ...'."""
    settings = ", ".join(f"{key}={value}" for key, value in (gated.get("settings") or {}).items()) or "no settings"
    schemes = ", ".join(f"{asked} as {computed}" for asked, computed in (gated.get("served_as") or {}).items())
    how = "as the engine's default serves it" if gated.get("numerics") == "engine_default" else "as the serve stage served it"
    outcome = {"passed": "its golden sets pass", "failed": "its golden sets fail"}.get(str(gated.get("status")), "not evaluated")
    return f"{how} ({settings}{': ' + schemes if schemes else ''}), {outcome}: {gated.get('reason')}"


def pending_sentence(row: dict[str, Any]) -> str:
    """Why a format whose quality passed is not approved yet, and what to run next."""
    lines = class_lines(row) or [f"no serving evidence: {'; '.join(row.get('reasons') or []) or 'none recorded'}"]
    return f"{display_name(row)} passes every quality gate and is pending serving: {' '.join(lines)}"


def engine_default_sentence(row: dict[str, Any]) -> str | None:
    """Where the engine's default would serve another scheme than was gated (INT4 as W4A8 on an AMX
    CPU): what it would serve and how far that is from the gated numerics."""
    serving = row.get("serving") or {}
    default = serving.get("engine_default")
    if not default:
        return None
    schemes = ", ".join(f"{gated} as {served}" for gated, served in (default.get("served_as") or {}).items())
    settings = ", ".join(f"{key}={value}" for key, value in (serving.get("engine_settings") or {}).items())
    head = (f"{display_name(row)}: vLLM's defaults on {serving.get('device_class')} would serve {schemes}; the serve stage "
            f"served it as gated ({settings})")
    agreement = default.get("agreement")
    if not agreement:
        return f"{head}; the default could not be measured: {default.get('reason', 'no record')}."
    return (f"{head}. Under the default, served log-probs differ from gated by {agreement['mean_abs_logprob_difference']:.3f} nats "
            f"a token (mean; p99 {agreement['p99_abs_logprob_difference']:.3f}), NLL {agreement['nll_change']:+.4f} nats a token.")


def mix_text(groups_by_format: dict[str, int]) -> str:
    """'mixed: 59 groups gptq-int4, 61 smoothquant-w8a8'."""
    parts = [f"{count} {'group' if count == 1 else 'groups'} {fmt}" if index == 0 else f"{count} {fmt}"
             for index, (fmt, count) in enumerate(groups_by_format.items())]
    return "mixed: " + ", ".join(parts) if parts else "mixed"


def display_name(row: dict[str, Any]) -> str:
    """A row's name in a sentence: the format, or 'search-2 on held-out items' for a held-out gate."""
    if search_role(row) == HELD_OUT:
        return f"{row['search']['checkpoint']} on held-out items"
    return str(row["format"])


def long_name(row: dict[str, Any]) -> str:
    """A search row with its mix: 'search-2 (mixed: 59 groups gptq-int4, 61 smoothquant-w8a8)'."""
    if search_role(row) is None:
        return str(row["format"])
    return f"{display_name(row)} ({mix_text(row['search'].get('groups_by_format') or {})})"


def recommendation(rows: list[dict[str, Any]], profile: str) -> str | None:
    """The approved format with the lowest batch-1 decode bound on `profile`, or None. A mixed
    checkpoint counts by its held-out verdict (row `<trial>@held-out`) only, never by a trial's."""
    approved = [row for row in rows if deployable(row) and profile in row.get("bounds", {})]
    if not approved:
        return None
    return min(approved, key=lambda row: row["bounds"][profile]["batch1_ms"])["format"]


def measured_recommendation(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """On the machine the serve stage ran on: the deployable format vLLM decodes fastest at batch 1
    (measured tokens/s, median of runs), with the baseline's rate and the approved formats that
    decode slower than it there; None without serve checks."""
    def rate(row: dict[str, Any]) -> float | None:
        serving = row.get("serving") or {}
        entry = (serving.get("throughput") or {}).get("1") if serving.get("served") else None
        return None if entry is None else float(entry["tokens_per_s"])

    baseline = next((row for row in rows if row["verdict"] == "baseline"), None)
    measured = [row for row in rows if deployable(row) and rate(row) is not None]
    if not measured and (baseline is None or rate(baseline) is None):
        return None
    best = max(measured, key=lambda row: rate(row) or 0.0) if measured else None
    base_rate = None if baseline is None else rate(baseline)
    return {"format": None if best is None else display_name(best), "tokens_per_s": None if best is None else rate(best),
            "baseline_tokens_per_s": base_rate,
            "slower_than_baseline": [display_name(row) for row in measured if base_rate is not None and (rate(row) or 0.0) < base_rate],
            "device": ((best or baseline or {}).get("serving") or {}).get("device")}


def measured_sentence(report: dict[str, Any]) -> str | None:
    """The recommendation for the machine the serve stage measured, from measured decode rates."""
    choice = report.get("measured_recommendation")
    if not choice:
        return None
    where = f"this machine ({choice.get('device') or '?'}, vLLM, measured)"
    base = choice.get("baseline_tokens_per_s")
    base_text = f"; the 16-bit baseline decodes at {base:.1f} tokens/s there" if base is not None else ""
    if choice.get("format") is None:
        return f"On {where}: no approved format was served{base_text}."
    sentence = f"On {where}: {choice['format']}, the approved format vLLM decodes fastest at batch 1 ({choice['tokens_per_s']:.1f} tokens/s){base_text}."
    slower = choice.get("slower_than_baseline") or []
    if slower:
        sentence += (f" {', '.join(slower)} {'decodes' if len(slower) == 1 else 'decode'} slower than the baseline here: "
                     "fewer bytes do not pay where the kernels, not memory, bound a step.")
    return sentence


def pareto_front(points: list[tuple[float, float, str]], higher_is_better: bool = True) -> list[tuple[float, float, str]]:
    """Points (size, quality, label) not beaten by another that is no larger and no worse."""
    sign = 1.0 if higher_is_better else -1.0
    front, best = [], float("-inf")
    for size, quality, label in sorted(points, key=lambda p: (p[0], -sign * p[1])):
        if sign * quality > best:
            front.append((size, quality, label))
            best = sign * quality
    return front


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def policy_label(policy: dict[str, Any]) -> str:
    """'small-model@v2', or 'small-model@v2 narrowed to arc-easy, wiki-text (dropped: hellaswag)'
    for a policy the plan narrowed (its identity's `narrowed_to` and `dropped`)."""
    label = f"{policy.get('name', '?')}@{policy.get('version', '?')}"
    if policy.get("narrowed_to") is None:
        return label
    label += f" narrowed to {', '.join(policy['narrowed_to'])}"
    return label + (f" (dropped: {', '.join(policy['dropped'])})" if policy.get("dropped") else "")


def _set_name(spec: str) -> str:
    """'wiki-text' for 'wiki-text@v1' (a spec this version cannot parse: as it is)."""
    try:
        return SetRef.parse(spec).name
    except InputError:
        return spec


# ---- a gate's numbers -------------------------------------------------------------------------

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


def _gates(row: dict[str, Any]) -> list[dict[str, Any]]:
    return list(row.get("gates") or [])


def _gate_id(gate: dict[str, Any]) -> GateId | None:
    try:
        return GateId.parse(gate["gate"])
    except (InputError, KeyError):
        return None


def _on_golden_set(gate: dict[str, Any]) -> bool:
    gate_id = _gate_id(gate)
    return gate_id is not None and gate_id.on_golden_set


def _label(gate: dict[str, Any]) -> str:
    """'wiki-text kl_divergence': the set without its version, as the gates' reasons name it."""
    gate_id = _gate_id(gate)
    if gate_id is None:
        return str(gate.get("gate", "?"))
    try:
        scope = SetRef.parse(gate_id.scope).name if gate_id.on_golden_set else gate_id.scope
    except InputError:
        scope = gate_id.scope
    return f"{scope} {gate_id.check}"


def _higher_is_better(gate: dict[str, Any]) -> bool:
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
    estimate, limit, outcome = gate.get("estimate"), gate.get("limit"), gate.get("outcome")
    if _finite(estimate) and _finite(limit) and estimate != limit and outcome in (PASS, FAIL):
        return (estimate > limit) == (outcome == PASS)
    return False


def _limit_text(gate: dict[str, Any], short: bool = True) -> str:
    relation = "≥" if _higher_is_better(gate) else "≤"
    unit = gate.get("unit", "")
    return f"{relation} {_amount(gate.get('limit'), unit, limit=True)}{_suffix(unit, short)}"


def _exact(gate: dict[str, Any]) -> bool:
    """A size or integrity check: one exact number, no interval."""
    return gate.get("decided_by") == "exact" or not _on_golden_set(gate)


def _interval_text(gate: dict[str, Any]) -> str:
    if _exact(gate) or gate.get("low") is None or gate.get("high") is None:
        return "–"
    unit = gate.get("unit", "")
    return f"[{_amount(gate['low'], unit)}, {_amount(gate['high'], unit)}]"


def _estimate_text(gate: dict[str, Any], short: bool = True) -> str:
    if gate.get("estimate") is None:
        return "–"
    unit = gate.get("unit", "")
    return f"{_amount(gate['estimate'], unit)}{_suffix(unit, short)}"


def _look_text(gate: dict[str, Any]) -> str:
    look, looks = gate.get("look"), gate.get("looks")
    text = f"{look} of {looks}" if look is not None and looks is not None else "–"
    decided_by = gate.get("decided_by")
    return f"{text}, by {decided_by}" if decided_by in ("interval", "ceiling") else text


def _confidence_text(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.3g}%"


def _spread_text(gate: dict[str, Any], key: str) -> str:
    value = gate.get(key)
    if value is None:
        return "–"
    unit = gate.get("unit", "")
    return f"{_amount(value, unit, signed=False)}{_suffix(unit, short=True)}"


def _counts(row: dict[str, Any]) -> tuple[int, int, int]:
    """(gates in all, gates that blocked: failed or insufficient evidence, gates not evaluated)."""
    gates = _gates(row)
    return (len(gates), sum(gate.get("outcome") in BLOCKING for gate in gates),
            sum(gate.get("outcome") == NOT_EVALUATED for gate in gates))


def _gate_items(row: dict[str, Any]) -> dict[str, int]:
    """Set spec -> the most items any of its decided gates saw (a verdict record without
    `sequential`: the only count it holds)."""
    per_set: dict[str, int] = {}
    for gate in _gates(row):
        gate_id = _gate_id(gate)
        if gate_id is not None and gate_id.on_golden_set and gate.get("items") is not None:
            per_set[gate_id.scope] = max(per_set.get(gate_id.scope, 0), int(gate["items"]))
    return per_set


def depths(row: dict[str, Any]) -> dict[str, int] | None:
    """Set spec -> items the format was evaluated on (0: not run), as its looks went
    (the verdict's `sequential.items`); None for a record without them."""
    items = (row.get("sequential") or {}).get("items")
    return {spec: int(count) for spec, count in items.items()} if isinstance(items, dict) else None


def items_evaluated(row: dict[str, Any]) -> int | None:
    """Items a format was evaluated on, over its golden sets: its looks' depths where the
    verdict records them, else (an older record) each set once, at the most items any of its
    decided gates saw."""
    per_set = depths(row)
    if per_set is None:
        per_set = _gate_items(row)
    return sum(per_set.values()) if per_set else None


def _items_list(per_set: dict[str, int]) -> str:
    """'wiki-text 25, lambada 240, arc-easy 0'."""
    return ", ".join(f"{_set_name(spec)} {count:,}" for spec, count in per_set.items())


def baseline_depths(report: dict[str, Any]) -> dict[str, int] | None:
    """Set spec -> items the baseline was evaluated on: each set's first look (its own values),
    and as deep as any format went (paired with it, item by item); None when no row records
    its looks."""
    # a held-out gate's items are after the plan's: not the baseline's first N
    paired = (depths(row) for row in report["rows"] if row["verdict"] != "baseline" and search_role(row) != HELD_OUT)
    recorded = [per_set for per_set in paired if per_set is not None]
    if not recorded:
        return None
    result = {entry["spec"]: int(entry["items"]) for entry in report.get("evalsets") or []}
    for per_set in recorded:
        for spec, count in per_set.items():
            result[spec] = max(result.get(spec, 0), count)
    return result


def split_offsets(row: dict[str, Any]) -> dict[str, int]:
    """Set spec -> the items a search row's split skips (a held-out gate: the plan's items); {} otherwise."""
    split = (row.get("search") or {}).get("split_items") or {}
    return {spec: int(entry.get("offset") or 0) for spec, entry in split.items() if isinstance(entry, dict)}


def split_items_text(row: dict[str, Any]) -> str:
    """'lambada items 5–8, wiki-text items 5–8': the items of each set a search row was judged on
    (from its split's offsets and its looks' depths, else the split's ceiling)."""
    split = (row.get("search") or {}).get("split_items") or {}
    per_set = depths(row) or {}
    parts = []
    for spec, entry in split.items():
        offset, count = int(entry.get("offset") or 0), per_set.get(spec, entry.get("ceiling"))
        parts.append(f"{_set_name(spec)} items {offset + 1:,}–{offset + int(count):,}" if count else f"{_set_name(spec)} not run")
    return ", ".join(parts)


def _verdict_note(row: dict[str, Any]) -> str:
    """'blocked by 2 of 9 gates, 4 not evaluated' / 'all 9 gates passed'."""
    total, blocking, skipped = _counts(row)
    if row["verdict"] == "baseline":
        return ""
    if not total:
        reasons = len(row.get("reasons") or [])
        return f"{reasons} reason{'s' if reasons != 1 else ''}" if reasons else ""
    if row["verdict"] == "approved":
        return f"all {total} gates passed" if blocking + skipped == 0 else f"{total - blocking - skipped} of {total} gates passed"
    note = f"{blocking} of {total} gates failed"
    return note + (f", {skipped} not evaluated" if skipped else "")


# ---- the summary ------------------------------------------------------------------------------

def _decided(gate: dict[str, Any]) -> str:
    """', decided after 25 items (look 1 of 3)': how much evidence settled a metric gate."""
    if _exact(gate) or gate.get("items") is None:
        return ""
    text = f", decided after {gate['items']} items"
    if (gate.get("looks") or 1) > 1 and gate.get("look") is not None:
        text += f" (look {gate['look']} of {gate['looks']})"
    return text


def _gate_phrase(gate: dict[str, Any]) -> str:
    """One blocking gate in a sentence: its numbers against its limit (without `_decided`)."""
    estimate, outcome = gate.get("estimate"), gate.get("outcome")
    if _exact(gate) or not _finite(estimate):
        return str(gate.get("reason") or f"{_label(gate)} {outcome}")
    unit = gate.get("unit", "")
    observed = f"{_label(gate)} {_amount(estimate, unit)}{_suffix(unit)} {_interval_text(gate)}"
    limit = _amount(gate.get("limit"), unit, limit=True) + _suffix(unit)
    if outcome == FAIL:
        return f"{observed} {'below' if _higher_is_better(gate) else 'above'} {limit}"
    return f"{observed}, insufficient evidence against the limit {limit}"


def _join(phrases: list[str]) -> str:
    # the phrases hold commas of their own, so semicolons separate them
    return phrases[0] if len(phrases) == 1 else "; ".join(phrases[:-1]) + "; and " + phrases[-1]


def blocked_sentence(row: dict[str, Any]) -> str:
    """Why a blocked format is blocked, in one sentence naming the gates that decided it."""
    gates = _gates(row)
    if not gates:  # a verdict record from before gates were recorded one by one
        reasons = row.get("reasons") or []
        return f"{display_name(row)} is blocked" + (f": {'; '.join(reasons)}." if reasons else ".")
    blocking = [gate for gate in gates if gate.get("outcome") in BLOCKING]
    skipped = [gate for gate in gates if gate.get("outcome") == NOT_EVALUATED]
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


def recommendation_sentences(report: dict[str, Any]) -> list[str]:
    """Per hardware profile, the recommended format and why, one sentence each; then this
    machine's, from the serve stage's measured decode rates (where it ran)."""
    rows = {row["format"]: row for row in report["rows"]}
    sentences = []
    for profile, choice in report["recommendation"].items():
        if choice is None:
            sentences.append(f"On {profile}: no format is approved, so none is recommended.")
            continue
        row = rows[choice]
        bound = row.get("bounds", {}).get(profile, {})
        ratio = row.get("ratio_to_baseline")
        size = f", {ratio:.2f}x the baseline's bytes" if ratio is not None else ""
        what = choice
        if search_role(row) == HELD_OUT:  # the search's checkpoint, by the verdict that approved it
            trial = row["search"]["checkpoint"]
            what = (f"{trial} ({mix_text(row['search'].get('groups_by_format') or {})}), the mixed checkpoint "
                    f"checkpoints/{trial} approved on held-out items")
        sentences.append(f"On {profile}: {what}, the approved format with the lowest batch-1 decode bound "
                         f"({bound.get('batch1_ms', float('nan')):.3f} ms a step, a lower bound{size}).")
    measured = measured_sentence(report)
    return sentences + ([measured] if measured else [])


# ---- served in vLLM ---------------------------------------------------------------------------

SERVING_HEADER = ["checkpoint", "served", "|logprob diff| mean / p99 (bound)", "KL served‖gated", "top-1", "greedy identical",
                  "tokens/s b1 (bound)", "tokens/s b8 (bound)"]


def _serving_bound(row: dict[str, Any], check: str) -> str:
    gate = next((gate for gate in _gates(row) if gate.get("gate") == f"serving {check}"), None)
    return f"{gate['limit']:.3f}" if gate and _finite(gate.get("limit")) and gate.get("outcome") != "not evaluated" else "–"


def _rate(serving: dict[str, Any], batch: str) -> str:
    entry = (serving.get("throughput") or {}).get(batch)
    return "–" if entry is None else f"{entry['tokens_per_s']:.1f} ({entry['bound_tokens_per_s']:,.0f})"


def serving_table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per checkpoint the serve stage checked (the baseline, the formats, a search's trials and its
    held-out gate): served or not, the agreement with what was gated
    against the serving gate's bounds, greedy continuations, measured decode tokens/s against the
    bound at the measured copy bandwidth."""
    rows = []
    for row in report["rows"]:
        serving = row.get("serving")
        if not serving:
            continue
        name = display_name(row) if row["verdict"] != "baseline" else "baseline"
        if not serving.get("served"):
            said = "pending" if serving.get("status") in (PENDING, FAILED) else "no"
            rows.append([name, f"{said}: {serving.get('reason', '?')}", "–", "–", "–", "–", "–", "–"])
            continue
        agreement, greedy = serving.get("agreement"), serving.get("greedy")
        if agreement:
            bounds = [_serving_bound(row, "mean_logprob_difference"), _serving_bound(row, "p99_logprob_difference")]
            bound = f" ({' / '.join(bounds)})" if row["verdict"] != "baseline" and bounds != ["–", "–"] else ""
            cells = [f"{agreement['mean_abs_logprob_difference']:.3f} / {agreement['p99_abs_logprob_difference']:.3f}{bound}",
                     f"{agreement['kl_served_gated_mean']:.4f}", f"{agreement['top1_agreement']:.3f}"]
        else:
            cells = ["not measured", "–", "–"]
        greedy_cell = f"{greedy['identical']} of {greedy['prompts']}" if greedy else "–"
        rows.append([name, f"yes ({serving.get('dtype')})", *cells, greedy_cell, _rate(serving, "1"), _rate(serving, "8")])
    return SERVING_HEADER, rows


def serving_note(report: dict[str, Any]) -> str:
    """What the serving table's numbers are."""
    measured = [row["serving"]["bandwidth_bytes_per_s"] / 1e9 for row in report["rows"]
                if row.get("serving") and row["serving"].get("bandwidth_bytes_per_s")]
    engine = next((row["serving"].get("engine") for row in report["rows"] if row.get("serving") and row["serving"].get("engine")), None)
    which = f"vLLM {engine['version']} ({engine['engine']})" if engine else "vLLM"
    span = f"{min(measured):.1f}" if measured and max(measured) - min(measured) < 0.05 else \
        f"{min(measured):.1f}-{max(measured):.1f}" if measured else ""
    at = f" at the copy bandwidth each checkpoint's worker measured ({span} GB/s)" if measured else ""
    return (f"Each checkpoint served by {which} and compared with the evaluation its gate saw, token by token on the same "
            "token ids: |served - gated| log-probability of each token (nats; the bounds in brackets are the serving gate's: "
            "the baseline's own difference plus the policy's margin), KL(served‖gated) from the served top-k, top-1 agreement, "
            "greedy continuations identical to the gated model's. Decode tokens/s are measured on the machine the run used "
            f"(median of runs); the bound in brackets reads every stored byte once a step{at}, an upper bound.")


def approved_sentence(report: dict[str, Any]) -> str:
    """The approved formats (and the search's checkpoint, approved on held-out items); a trial
    that passed the search split only is not among them (`search_sentences` names it)."""
    approved = [display_name(row) for row in report["rows"] if deployable(row)]
    candidates = [row for row in report["rows"] if row["verdict"] != "baseline" and search_role(row) != TRIAL]
    pending = [row for row in candidates if row["verdict"] == PENDING]
    if not approved:
        if pending:
            return (f"No format is approved yet: {len(pending)} of {len(candidates)} pass every quality gate and are pending "
                    f"serving ({', '.join(display_name(row) for row in pending)}), the rest are blocked.")
        return f"No format is approved: all {len(candidates)} are blocked."
    listed = approved[0] if len(approved) == 1 else ", ".join(approved[:-1]) + " and " + approved[-1]
    return f"Approved, every gate passed: {listed} ({len(approved)} of {len(candidates)} formats)."


def search_sentences(report: dict[str, Any]) -> list[str]:
    """The search's conclusion, and the trials that passed the search split only (not approved
    for release); none without a search."""
    search = report.get("search")
    if not search:
        return []
    sentences = [f"Mixed-precision search: {str(search.get('conclusion') or 'no conclusion recorded').rstrip('.')}."]
    approved_held_out = (search.get("held_out") or {}).get("verdict") == "approved"
    passed = [row["format"] for row in report["rows"] if search_role(row) == TRIAL and row["verdict"] == "approved"
              and not (approved_held_out and row["format"] == search.get("chosen"))]
    if passed:
        listed = passed[0] if len(passed) == 1 else ", ".join(passed[:-1]) + " and " + passed[-1]
        verb = "passed" if len(passed) == 1 else "each passed"
        sentences.append(f"{listed} {verb} the search split only, so {'it is not' if len(passed) == 1 else 'none is'} approved for release: "
                         "a trial's own verdict was reached on the items that selected it, and only the held-out gate "
                         "can approve a mixed checkpoint.")
    return sentences


def policy_line(report: dict[str, Any]) -> str:
    """The page's header line: the policy, narrowed or not, and its hash."""
    policy = report["policy"]
    return (f"Policy {policy_label(policy)}; sha256 {str(policy.get('sha256', ''))[:12]}. "
            "Decode times are lower bounds from peak bandwidth and FLOP/s, not measurements.")


def narrowed_sentence(report: dict[str, Any]) -> str | None:
    """For a narrowed policy, what its verdicts do not cover; None for a whole policy."""
    policy = report["policy"]
    if policy.get("narrowed_to") is None:
        return None
    dropped = list(policy.get("dropped") or [])
    sentence = f"Gated under policy {policy_label(policy)}"
    if not dropped:
        return sentence + "."
    them = "it" if len(dropped) == 1 else "them"
    return sentence + f": no gate on {', '.join(dropped)} was applied, so no verdict here speaks for {them}."


# ---- the search ---------------------------------------------------------------------------------

SEARCH_HEADER = ["trial", "budget (x baseline)", "bytes (x baseline)", "predicted cost", "groups per format",
                 "verdict on the search split", "first reason"]


def conclusion_sentence(report: dict[str, Any]) -> str:
    """The search's conclusion (gates.search.conclusion) as a sentence of its own: capitalised
    unless it starts with a name ('search-2 (0.399x ...'), with its full stop."""
    text = str((report.get("search") or {}).get("conclusion") or "no conclusion recorded").rstrip(".")
    first = text.split(" ", 1)[0]
    return (text[0].upper() + text[1:] if first.isalpha() else text) + "."


def _ratio(value: Any) -> str:
    return f"{value:.3f}" if _finite(value) else "–"


def search_table(report: dict[str, Any]) -> list[list[str]]:
    """One row per trial (SEARCH_HEADER): its byte budget and stored bytes as ratios to the
    baseline's tensor bytes, the allocation's predicted cost, its groups per format, its verdict
    on the search split and the first reason; the chosen trial marked."""
    search = report.get("search") or {}
    rows = []
    for trial in search.get("trials") or []:
        name = str(trial.get("name", "?")) + (" (chosen)" if trial.get("name") == search.get("chosen") else "")
        groups = ", ".join(f"{fmt} {count}" for fmt, count in (trial.get("groups_by_format") or {}).items())
        verdict = "passed the search split" if trial.get("verdict") == "approved" else "blocked on the search split"
        cost = trial.get("predicted_cost")
        rows.append([name, _ratio(trial.get("budget_ratio")), _ratio(trial.get("ratio")), f"{cost:.3g}" if _finite(cost) else "–",
                     groups or "–", verdict, str((trial.get("reasons") or ["–"])[0])])
    return rows


def _search_row(report: dict[str, Any], role: str, checkpoint: str) -> dict[str, Any] | None:
    return next((row for row in report["rows"] if search_role(row) == role and row["search"].get("checkpoint") == checkpoint), None)


def held_out_sentence(report: dict[str, Any]) -> str:
    """The search's result: the chosen trial's held-out verdict, on which items, and its reason."""
    search = report.get("search") or {}
    chosen, held = search.get("chosen"), search.get("held_out")
    if not chosen and not search.get("trials"):
        return "No trial ran, so no mixed checkpoint was gated on held-out items."
    if not chosen:
        return "No trial passed the search split, so none was gated on held-out items and no mixed checkpoint is approved."
    if not held:
        return f"{chosen} passed the search split; its held-out gate has not run, so it is not approved."
    row = _search_row(report, HELD_OUT, str(chosen))
    items = f" ({split_items_text(row)})" if row is not None and split_items_text(row) else ""
    if held.get("verdict") == "approved":
        return (f"{chosen}: approved on held-out items{items}, items no trial was judged on; this verdict alone approves "
                f"the mixed checkpoint checkpoints/{chosen}.")
    reasons = list(held.get("reasons") or []) or ["no reason recorded"]
    more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
    return f"{chosen}: blocked on held-out items{items}: {reasons[0]}{more}."


def search_lines(report: dict[str, Any]) -> list[str]:
    """What the search section says beside its table: the trials' items, the repeats, its settings."""
    search = report.get("search") or {}
    lines = []
    trial = next((row for row in report["rows"] if search_role(row) == TRIAL), None)
    if trial is not None and split_items_text(trial):
        lines.append(f"Each trial was judged on the search split ({split_items_text(trial)}): the items that selected "
                     "the trial, so a trial's own verdict approves nothing.")
    repeats = list(search.get("repeats") or [])
    if repeats:
        same = sorted({str(entry.get("same_as")) for entry in repeats})
        lines.append(f"{len(repeats)} budget{'s' if len(repeats) != 1 else ''} gave the allocation of an earlier trial "
                     f"({', '.join(same)}), whose verdict stood for {'them' if len(repeats) != 1 else 'it'}: not quantized again.")
    else:
        lines.append("No budget repeated an earlier trial's allocation (0 repeats).")
    space = search.get("space") or {}
    baseline = space.get("baseline_bytes")
    bounds = ""
    if _finite(baseline) and baseline and _finite(search.get("lo_bytes")) and _finite(search.get("ceiling_bytes")):
        bounds = (f"; budgets between {search['lo_bytes'] / baseline:.3f}x (the smallest format it mixes) and "
                  f"{search['ceiling_bytes'] / baseline:.3f}x the baseline's tensor bytes")
    lines.append(f"Objective {search.get('objective', '?')}, at most {search.get('max_trials', '?')} trials, mixing "
                 f"{', '.join(search.get('formats') or [])} over {space.get('groups', '?')} layer groups{bounds}. "
                 "The predicted cost is the allocation's summed sensitivity score.")
    return lines


def _allocation(report: dict[str, Any]) -> tuple[str, dict[str, str]] | None:
    """The chosen trial's name and its group -> format, for the sensitivity chart's strip."""
    search = report.get("search") or {}
    trial = next((entry for entry in search.get("trials") or [] if entry.get("name") == search.get("chosen")), None)
    choice = ((trial or {}).get("allocation") or {}).get("choice")
    return (str(trial["name"]), dict(choice)) if trial is not None and isinstance(choice, dict) else None


def sensitivity_caption(report: dict[str, Any]) -> str:
    """What the sensitivity chart shows: the method and its formula, the unit, the calibration
    tokens, the log scale, the strip, and the rank check where the artifact holds one."""
    data = report.get("sensitivity") or {}
    tokens = f" from {data['tokens']:,} calibration tokens" if isinstance(data.get("tokens"), int) else ""
    fisher = f", {data['fisher']} Fisher" if data.get("fisher") else ""
    formula = f" ({data['formula']})" if data.get("formula") else ""
    text = (f"Per-layer-group sensitivity by {data.get('method', 'an unnamed method')}{formula}, in "
            f"{data.get('unit', 'its own unit')}{tokens}{fisher}: one point per layer group and format, on a log scale "
            "(a zero score is a hollow point on the floor).")
    allocation = _allocation(report)
    if allocation:
        text += f" The strip under the axis: the format {allocation[0]} gave each group (grey: left at 16 bits)."
    spearman = {fmt: rho for fmt, rho in (data.get("spearman") or {}).items() if _finite(rho)}
    if spearman:
        text += (" Rank correlation (Spearman) of the per-block sums with the KL measured by quantizing each block alone: "
                 + ", ".join(f"{fmt} {rho:.2f}" for fmt, rho in spearman.items()) + ".")
    return text


def sensitivity_table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The chart's numbers: one row per layer group, a score per format (and the chosen trial's choice)."""
    data = report.get("sensitivity") or {}
    formats = list(data.get("formats") or [])
    allocation = _allocation(report)
    header = ["#", "layer group", "block", *formats] + ([allocation[0]] if allocation else [])
    rows = []
    for index, group in enumerate(data.get("groups") or []):
        cells = [str(index), str(group.get("name", "?")), _number(group.get("block"))]
        cells += [f"{group['scores'][fmt]:.3g}" if _finite(group.get("scores", {}).get(fmt)) else "–" for fmt in formats]
        if allocation:
            cells.append(allocation[1].get(str(group.get("name")), "–"))
        rows.append(cells)
    return header, rows


# ---- the main table ---------------------------------------------------------------------------

def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The compact table: one row per format, few columns (the gates' numbers are in each
    candidate's section), so that it fits a 1280-pixel window."""
    profiles = [profile["name"] for profile in report["hardware"]]
    header = ["format", "MB", "x baseline", "bits/weight"] + [f"{p} b1 ms" for p in profiles] + ["KL", "verdict", "items"]
    baseline_per_set = baseline_depths(report)
    baseline_items: str | int | None = (_items_list(baseline_per_set) if baseline_per_set is not None
                                        else sum(entry["items"] for entry in report.get("evalsets") or []) or None)
    rows = []
    for row in report["rows"]:
        bits = row.get("bits_per_weight_layers")
        if bits is None:
            bits = row.get("bits_per_parameter")  # the baseline: no quantized layers, its dtype's bits
        cells = [row["format"], _number(None if row.get("bytes") is None else row["bytes"] / 1e6, 1),
                 _number(row.get("ratio_to_baseline"), 2), _number(bits, 2)]
        for profile in profiles:
            bound = row.get("bounds", {}).get(profile)
            cells.append(f"{bound['batch1_ms']:.3f}" if bound else "–")
        per_set = depths(row)
        if row["verdict"] == "baseline":
            items = baseline_items
        else:  # per set as the looks went; an older record: the items of its decided gates, summed
            items = _items_list(per_set) if per_set is not None else items_evaluated(row)
        cells += [_number(row.get("kl_divergence"), 4), verdict_text(row), _number(items)]
        rows.append(cells)
    return header, rows


# ---- a candidate's details --------------------------------------------------------------------

GATE_HEADER = ["gate", "outcome", "estimate", "interval", "limit", "items", "look", "confidence",
               "± half-width", "detectable", "stability", "reason"]


def gate_cells(gate: dict[str, Any]) -> list[str]:
    """One row of a candidate's gate table (GATE_HEADER)."""
    return [str(gate.get("gate", "?")), str(gate.get("outcome", "?")), _estimate_text(gate), _interval_text(gate),
            _limit_text(gate), _number(gate.get("items")), _look_text(gate), _confidence_text(gate.get("confidence")),
            _spread_text(gate, "half_width"), _spread_text(gate, "detectable"), stability_text(gate), str(gate.get("reason", ""))]


def facts_sentence(row: dict[str, Any], profiles: list[str]) -> str:
    """A format's size and decode bounds (batch 1 and 32) in one sentence."""
    parts = []
    if row.get("bytes") is not None:
        ratio = row.get("ratio_to_baseline")
        relative = ratio is not None and row["verdict"] != "baseline"
        parts.append(f"{row['bytes'] / 1e6:.1f} MB" + (f" ({ratio:.2f}x the baseline)" if relative else ""))
    if row.get("bits_per_weight_layers") is not None:
        parts.append(f"{row['bits_per_weight_layers']:.2f} bits per weight in the quantized layers")
    if row.get("bits_per_parameter") is not None:
        parts.append(f"{row['bits_per_parameter']:.2f} bits per parameter over the whole model")
    bounds = [f"{p} {row['bounds'][p]['batch1_ms']:.3f} / {row['bounds'][p]['batch32_ms']:.3f} ms"
              for p in profiles if p in row.get("bounds", {})]
    text = "; ".join(parts) if parts else "not measured"
    if bounds:
        text += f". Decode-step lower bounds at batch 1 / 32: {', '.join(bounds)}"
    return text + "."


def forest_svg(row: dict[str, Any]) -> str:
    """Every metric gate of a candidate as one row: the interval as a line, the estimate as a
    dot, the limit as a mark, coloured by outcome. The gates are in different units (points,
    percent, nats, a share), so each row has its own scale: the limit sits at the same x in
    every row, each row is stretched to its own farthest number, and each row is turned so that
    the worse side is to the right. The numbers themselves are printed beside the row."""
    gates = [gate for gate in _gates(row) if _on_golden_set(gate)]
    label_w, plot_w, row_h, top = 210, 300, 26, 34
    centre, half = label_w + plot_w / 2, plot_w / 2 - 12
    text_x = label_w + plot_w + 18
    columns = (text_x, text_x + 190, text_x + 285)  # estimate [interval], limit, outcome
    width = columns[2] + 150  # room for "insufficient evidence" in bold: 968 px, inside a 1280-px window
    height = top + max(1, len(gates)) * row_h + 8
    name = html.escape(row["format"])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="forest" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" role="img" '
             f'aria-label="forest plot of the metric gates of {name}">',
             # the worse half of the plot area, tinted, so the side a row leans to reads at a glance
             f'<rect x="{centre:.1f}" y="{top - 6}" width="{plot_w / 2:.1f}" height="{height - top:.1f}" fill="#cf222e" fill-opacity="0.05"/>',
             f'<text x="{centre - 20:.1f}" y="22" text-anchor="end" fill="#59636e">← better</text>',
             f'<text x="{centre:.1f}" y="22" text-anchor="middle" fill="#59636e">limit</text>',
             f'<text x="{centre + 20:.1f}" y="22" fill="#59636e">worse →</text>',
             '<text x="8" y="22" font-weight="bold">gate</text>']
    for x, title in zip(columns, ("estimate [interval]", "limit", "outcome"), strict=True):
        parts.append(f'<text x="{x}" y="22" font-weight="bold">{title}</text>')
    if not gates:
        parts.append(f'<text x="8" y="{top + 17}" fill="#59636e">no metric gate was evaluated</text>')
    for index, gate in enumerate(gates):
        y = top + index * row_h + row_h / 2
        outcome = str(gate.get("outcome", ""))
        colour = COLOURS.get(outcome, COLOURS[NOT_EVALUATED])
        parts.append(f'<g class="gate {html.escape(outcome.replace(" ", "-"))}"><title>{html.escape(str(gate.get("reason", "")))}</title>')
        if index % 2:
            parts.append(f'<rect x="0" y="{y - row_h / 2:.1f}" width="{width}" height="{row_h}" fill="#f6f8fa" fill-opacity="0.7"/>')
        label = _label(gate)
        label = label if len(label) <= 32 else label[:31] + "…"
        parts.append(f'<text x="8" y="{y + 4:.1f}">{html.escape(label)}</text>')
        parts.append(f'<line x1="{centre:.1f}" y1="{y - 10:.1f}" x2="{centre:.1f}" y2="{y + 10:.1f}" stroke="#424a53" stroke-width="2"/>')
        limit, sign = gate.get("limit"), (-1.0 if _higher_is_better(gate) else 1.0)
        # how far past the limit, on the worse side (positive) or the better side (negative)
        ends = {key: sign * (gate[key] - limit) for key in ("low", "estimate", "high")
                if _finite(gate.get(key)) and _finite(limit)}
        # the row's own scale: its farthest number from the limit reaches the plot's edge
        scale = half / max((abs(value) for value in ends.values()), default=0.0) if any(ends.values()) else 0.0

        def x_of(distance: float, scale: float = scale) -> float:
            return centre + distance * scale

        if outcome != NOT_EVALUATED and "low" in ends and "high" in ends:
            x1, x2 = sorted((x_of(ends["low"]), x_of(ends["high"])))
            parts.append(f'<line class="interval" x1="{x1:.1f}" y1="{y:.1f}" x2="{x2:.1f}" y2="{y:.1f}" stroke="{colour}" stroke-width="3"/>')
            for end in (x1, x2):
                parts.append(f'<line x1="{end:.1f}" y1="{y - 5:.1f}" x2="{end:.1f}" y2="{y + 5:.1f}" stroke="{colour}" stroke-width="2"/>')
        if outcome != NOT_EVALUATED and "estimate" in ends:
            parts.append(f'<circle class="estimate" cx="{x_of(ends["estimate"]):.1f}" cy="{y:.1f}" r="5.5" fill="{colour}" stroke="#ffffff"/>')
        numbers = "–" if outcome == NOT_EVALUATED else f"{_estimate_text(gate)} {_interval_text(gate)}".replace(" –", "")
        parts.append(f'<text x="{columns[0]}" y="{y + 4:.1f}">{html.escape(numbers)}</text>'
                     f'<text x="{columns[1]}" y="{y + 4:.1f}">{html.escape(_limit_text(gate))}</text>'
                     f'<text x="{columns[2]}" y="{y + 4:.1f}" fill="{colour}" font-weight="bold">{html.escape(outcome)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


# ---- a candidate's verdict stability ------------------------------------------------------------

# A decided metric gate is flagged unstable below this share of its items' resamples deciding the
# same (gates.stats.STABILITY_BAR).
_DECIDED = (PASS, FAIL, INSUFFICIENT)


def _stable_gates(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's decided metric gates that carry a stability (verdicts from before it carry none)."""
    return [gate for gate in _gates(row) if _on_golden_set(gate) and gate.get("outcome") in _DECIDED
            and _finite(gate.get("stability"))]


def stability_text(gate: dict[str, Any]) -> str:
    """A gate's stability cell: the share to two decimals, 'exact' for a size, integrity or
    serving check (one exact number: no resample changes it), '–' where none was computed."""
    if _exact(gate) and gate.get("outcome") != NOT_EVALUATED:
        return "exact"
    value = gate.get("stability")
    return f"{value:.2f}" if _finite(value) else "–"


def unstable_gates(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The decided metric gates whose stability is below STABILITY_BAR."""
    return [gate for gate in _stable_gates(row) if gate["stability"] < STABILITY_BAR]


def stability_lines(row: dict[str, Any]) -> list[str]:
    """One line per unstable gate, or one saying every decided gate is stable; none when no gate
    carries a stability."""
    stable = _stable_gates(row)
    if not stable:
        return []
    lines = [f"{_label(gate)} ({gate['outcome']}) is unstable: a resample of its items decides otherwise in "
             f"{100 * (1 - gate['stability']):.0f}% of cases (stability {gate['stability']:.2f} over "
             f"{gate.get('stability_resamples') or '?'} resamples)" for gate in unstable_gates(row)]
    return lines or [f"Every decided metric gate is stable: at least {STABILITY_BAR:.0%} of the resamples of its items "
                     f"decide as it did (lowest {min(gate['stability'] for gate in stable):.2f})."]


def stability_svg(row: dict[str, Any]) -> str:
    """The decided metric gates' stability as bars (0 to 1), the bar at 0.9 marked; a bar below
    it is red and says so."""
    gates = _stable_gates(row)
    label_w, plot_w, row_h, top = 210, 300, 18, 24
    width, height = label_w + plot_w + 160, top + len(gates) * row_h + 6
    bar_x = label_w + plot_w * STABILITY_BAR
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="stability" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" role="img" '
             f'aria-label="verdict stability of the decided gates of {html.escape(row["format"])}">',
             '<text x="8" y="15" font-weight="bold">stability</text>',
             f'<text x="{label_w}" y="15" fill="#59636e">0</text><text x="{label_w + plot_w}" y="15" text-anchor="end" fill="#59636e">1</text>',
             f'<text x="{bar_x:.1f}" y="15" text-anchor="middle" fill="#59636e">{STABILITY_BAR:g}</text>']
    for index, gate in enumerate(gates):
        y, share = top + index * row_h, float(gate["stability"])
        unstable = share < STABILITY_BAR
        colour = COLOURS[FAIL] if unstable else COLOURS[PASS]
        note = "unstable" if unstable else ""
        parts.append(f'<g class="stability-row{" unstable" if unstable else ""}"><text x="8" y="{y + 12}">{html.escape(_label(gate))}</text>'
                     f'<rect x="{label_w}" y="{y + 3}" width="{plot_w * share:.1f}" height="{row_h - 6}" fill="{colour}" fill-opacity="0.75"/>'
                     f'<text x="{label_w + plot_w + 8}" y="{y + 12}">{share:.2f} {note}</text></g>')
    parts.append(f'<line x1="{bar_x:.1f}" y1="{top - 2}" x2="{bar_x:.1f}" y2="{height - 2}" stroke="#424a53" stroke-dasharray="3 2"/>')
    parts.append("</svg>")
    return "".join(parts)


# ---- a candidate's tails ------------------------------------------------------------------------

# The tails a verdict records for each text set (gates.verdict.TAIL_METRICS), as the table heads them.
TAIL_COLUMNS = (("kl_divergence", "mean KL"), ("kl_median", "median"), ("kl_p90", "p90"), ("kl_p99", "p99"),
                ("kl_p999", "p99.9"), ("kl_max", "max KL"), ("top_prob_change_mean", "mean Δp"),
                ("top_prob_change_p01", "p01 Δp"))
TAIL_HEADER = ["set", *(title for _, title in TAIL_COLUMNS)]


def _tails(row: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    return {spec: entry for spec, entry in (row.get("tails") or {}).items() if isinstance(entry, dict) and entry}


def tail_cells(row: dict[str, Any]) -> list[tuple[str, int | None, list[tuple[str, str]]]]:
    """Per text set: its name, the items, and per TAIL_COLUMNS (value, '[low, high]'), three
    significant digits ('–' for a tail the record lacks)."""
    result = []
    for spec, metrics in _tails(row).items():
        cells, items = [], None
        for name, _ in TAIL_COLUMNS:
            entry = metrics.get(name) or {}
            items = items if items is not None else entry.get("items")
            value = entry.get("estimate")
            low, high = entry.get("low"), entry.get("high")
            interval = f"[{_amount(low, '')}, {_amount(high, '')}]" if _finite(low) and _finite(high) else ""
            cells.append((_amount(value, "") if value is not None else "–", interval))
        result.append((_set_name(spec), items, cells))
    return result


def tails_note(row: dict[str, Any]) -> str:
    """What the tails table shows, and which of the tails a gate judged (those are in the forest
    plot as well)."""
    confidences = {entry.get("confidence") for metrics in _tails(row).values() for entry in metrics.values()
                   if isinstance(entry, dict) and entry.get("confidence") is not None}
    level = f"{_confidence_text(confidences.pop())} " if len(confidences) == 1 else ""
    names = {name for name, _ in TAIL_COLUMNS}
    gated = [_label(gate) for gate in _gates(row)
             if (gate_id := _gate_id(gate)) is not None and gate_id.on_golden_set and gate_id.check in names]
    which = (f"the gated ones ({', '.join(gated)}) are in the forest plot as well" if gated
             else "none is gated here (a gated one is in the forest plot as well)")
    return ("The per-token KL divergence from the baseline (nats) over each text set's evaluated items, and Δp, the change "
            "in the probability of the baseline's top token (negative: the format gives it less), each with its "
            f"{level}bootstrap interval over items, gated or not: {which}.")


# ---- what was measured ----------------------------------------------------------------------------

def _looks(entry: dict[str, Any]) -> list[int]:
    """A golden set's looks (item counts, the last its ceiling); a report of a run from before
    looks: one look, at the items it evaluated."""
    return [int(items) for items in entry.get("looks") or []] or [int(entry["items"])]


def measured_table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per golden set: its looks, its ceiling, and per format the items it was evaluated on
    (with the look that was), 'not run' where its looks never reached the set."""
    candidates = [row for row in report["rows"] if row["verdict"] != "baseline"]
    header = ["golden set", "looks at (items)", "ceiling", *(row["format"] for row in candidates)]
    rows = []
    for entry in report.get("evalsets") or []:
        looks = _looks(entry)
        size = entry.get("size")
        ceiling = f"{looks[-1]:,}" + (" (whole set)" if size == looks[-1] else f" of {size:,}" if size else "")
        cells = [entry["spec"], ", ".join(f"{items:,}" for items in looks), ceiling]
        for row in candidates:
            per_set = depths(row)
            if per_set is None:
                items = _gate_items(row).get(entry["spec"])
                cells.append("–" if items is None else f"{items:,}")
            elif not per_set.get(entry["spec"]):
                cells.append("not run")
            elif split_offsets(row).get(entry["spec"]):  # held out: the items after the plan's
                items, offset = per_set[entry["spec"]], split_offsets(row)[entry["spec"]]
                cells.append(f"{items:,} held out (items {offset + 1:,}–{offset + items:,})")
            else:
                items = per_set[entry["spec"]]
                look = f" (look {looks.index(items) + 1} of {len(looks)})" if items in looks and len(looks) > 1 else ""
                cells.append(f"{items:,}{look}")
        rows.append(cells)
    return header, rows


def context_lines(report: dict[str, Any]) -> list[str]:
    """The sizes behind the numbers: how many items each golden set contributed, the
    confidence level, the calibration set, the bounds' assumptions, the baseline's own numbers."""
    lines = []
    if report.get("evalsets"):
        lines.append(f"Golden sets: {', '.join(entry['spec'] for entry in report['evalsets'])}, each looked at on its first N items "
                     "for each N in its looks, the last its ceiling. A format's looks at a set stop at the look that decides all "
                     "its gates there, or once another gate has blocked the format (fail fast): the table below gives, per set, "
                     "the looks and the items each format was evaluated on.")
        lines.append(f"Differences are format minus baseline, item by item on the items the format was evaluated on, with "
                     f"{report.get('confidence', 0.95):.0%} paired-bootstrap intervals (a set looked at more than once "
                     "has each look's interval at a higher confidence; each gate's is in its candidate's table).")
    if report.get("calibration"):
        calibration = report["calibration"]
        lines.append(f"Calibration set: {calibration['samples']} x {calibration['seq_len']} tokens from {calibration['source']} "
                     f"(fingerprint {calibration['fingerprint'][:12]}).")
    if report.get("bounds_inputs"):
        inputs = report["bounds_inputs"]
        lines.append(f"Decode bounds: batch 1 and 32, {inputs['context_tokens']} context tokens a sequence, "
                     f"{inputs['kv_bytes_per_element']:g}-byte KV cache, peak bandwidth and FLOP/s of each profile.")
    baseline = next((row for row in report["rows"] if row["verdict"] == "baseline"), None)
    if baseline is not None:
        values = [f"{column} {entry['value']:.4f}" for column, entry in (baseline.get("metrics") or {}).items()
                  if _finite(entry.get("value"))]
        profiles = [profile["name"] for profile in report["hardware"]]
        first = ", ".join(f"{_set_name(entry['spec'])} {int(entry['items']):,}" for entry in report.get("evalsets") or [])
        at = f" Its values, at each set's first look ({first} items)" if first else " Its values"
        lines.append(f"Baseline: {facts_sentence(baseline, profiles)}" + (f"{at}: {', '.join(values)}." if values else ""))
    return lines


def _not_evaluated(row: dict[str, Any]) -> list[str]:
    return [f"{spec}: {why}" for spec, why in (row.get("not_evaluated") or {}).items()]


# ---- Markdown ---------------------------------------------------------------------------------

def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"


def markdown(report: dict[str, Any]) -> str:
    header, rows = table(report)
    profiles = [profile["name"] for profile in report["hardware"]]
    verdicts = {row["format"]: row for row in report["rows"]}
    lines = [f"# quantgate report: {report['model']}", "", policy_line(report), "", "## Summary", ""]
    lines += [f"- {sentence}" for sentence in recommendation_sentences(report)]
    lines += [f"- {approved_sentence(report)}"] + [f"- {sentence}" for sentence in search_sentences(report)]
    narrowed = narrowed_sentence(report)
    lines += [f"- {narrowed}"] if narrowed else []
    lines += [f"- {blocked_sentence(row)}" for row in report["rows"] if row["verdict"] == "blocked" and search_role(row) != TRIAL]
    lines += [f"- {pending_sentence(row)}" for row in report["rows"] if row["verdict"] == PENDING and search_role(row) != TRIAL]
    lines += [f"- {sentence}" for sentence in serving_class_sentences(report)]
    lines += ["", "## Formats", "", _md_row(header), "|" + "---|" * len(header)]
    for row, cells in zip(report["rows"], rows, strict=True):
        note = _verdict_note(row)
        lines.append(_md_row([long_name(row) if search_role(row) else cells[0], *cells[1:-2],
                              cells[-2] + (f" ({note})" if note else ""), cells[-1]]))
    lines += ["", "## Recommendation", "",
              "The approved format with the lowest batch-1 decode bound on each hardware profile"
              + (" (a mixed checkpoint by its held-out verdict only)" if report.get("search") else "") + ":", ""]
    for profile, choice in report["recommendation"].items():
        row = verdicts.get(choice or "")
        shown = f"{choice} ({verdict_text(row)}: checkpoints/{row['search']['checkpoint']})" if row and search_role(row) else choice
        lines.append(f"- {profile}: {shown or 'none (no format approved)'}")
    lines += _markdown_search(report)
    serving_header, serving_rows = serving_table(report)
    if serving_rows:
        lines += ["", "## Served in vLLM", "", serving_note(report), "", _md_row(serving_header), "|" + "---|" * len(serving_header)]
        lines += [_md_row(cells) for cells in serving_rows]
    lines += ["", "## Candidates"]
    for row in report["rows"]:
        if row["verdict"] == "baseline":
            continue
        lines += ["", f"### {row['format']}: {verdict_text(row)}", "", facts_sentence(row, profiles), ""]
        if search_role(row):
            lines += [search_note(row), ""]
        if row["verdict"] == "blocked":
            lines += [blocked_sentence(row), ""]
        gates = _gates(row)
        if gates:
            lines += [_md_row(GATE_HEADER), "|" + "---|" * len(GATE_HEADER)] + [_md_row(gate_cells(gate)) for gate in gates]
            stability = stability_lines(row)
            lines += ["", "Verdict stability:", ""] + [f"- {line}" for line in stability] if stability else []
        else:
            lines += [f"- {reason}" for reason in row.get("reasons") or []] or ["No gates recorded."]
        tails = tail_cells(row)
        if tails:
            lines += ["", "Tails of the per-token KL:", "", tails_note(row), "", _md_row(TAIL_HEADER), "|" + "---|" * len(TAIL_HEADER)]
            lines += [_md_row([name + (f" ({items:,} items)" if items is not None else "")]
                              + [f"{value} {interval}".strip() for value, interval in cells]) for name, items, cells in tails]
        skipped = _not_evaluated(row)
        if skipped:
            lines += ["", "Not evaluated:", ""] + [f"- {line}" for line in skipped]
    lines += ["", "## What was measured", ""] + [f"- {line}" for line in context_lines(report)]
    measured_header, measured_rows = measured_table(report)
    if measured_rows:
        lines += ["", "Items each format was evaluated on:", "", _md_row(measured_header), "|" + "---|" * len(measured_header)]
        lines += [_md_row(cells) for cells in measured_rows]
    return "\n".join(lines) + "\n"


def _markdown_search(report: dict[str, Any]) -> list[str]:
    """The search section of report.md: what the HTML's search section and sensitivity chart show."""
    search = report.get("search")
    if not search:
        return []
    lines = ["", "## Mixed-precision search", "", conclusion_sentence(report), "",
             f"Held-out gate: {held_out_sentence(report)}", ""]
    lines += [f"- {line}" for line in search_lines(report)]
    trials = search_table(report)
    if trials:
        lines += ["", _md_row(SEARCH_HEADER), "|" + "---|" * len(SEARCH_HEADER)] + [_md_row(cells) for cells in trials]
    if report.get("sensitivity"):
        header, rows = sensitivity_table(report)
        lines += ["", "### Per-layer sensitivity", "", sensitivity_caption(report), "", _md_row(header), "|" + "---|" * len(header)]
        lines += [_md_row(cells) for cells in rows]
    return lines


def search_note(row: dict[str, Any]) -> str:
    """A search row's candidate section: what judged it, and what its verdict can and cannot do."""
    info = row["search"]
    mix = mix_text(info.get("groups_by_format") or {})
    items = split_items_text(row)
    on = f" ({items})" if items else ""
    if search_role(row) == HELD_OUT:
        return (f"The search's result: {info['checkpoint']}'s mixed checkpoint ({mix}) gated once more, on held-out items no "
                f"trial was judged on{on}. This verdict, and no trial's, can approve the mixed checkpoint.")
    chosen = " The search chose it: its held-out gate is the search's result." if info.get("chosen") else ""
    return (f"A search trial ({mix}), judged on the search split{on}, the items that selected it: passing its gates there "
            f"does not approve it for release.{chosen}")


# ---- HTML ---------------------------------------------------------------------------------------

def _column_higher_is_better(column: str) -> bool:
    """Which way the plot's metric column ('SET METRIC') is better, from the metrics table
    (a metric this version does not know: lower, like a divergence)."""
    known = METRICS.get(GateId.parse(column).check)
    return known.higher_is_better if known is not None else False


TRIAL_COLOUR = "#8250df"  # the search's trials in the plot and the trials table
PLOT_COLOURS = {"approved": COLOURS[PASS], "blocked": COLOURS[FAIL], "baseline": "#57606a"}


def _plot_higher_is_better(report: dict[str, Any]) -> bool:
    plot = report["plot"]
    return bool(plot["higher_is_better"]) if "higher_is_better" in plot else _column_higher_is_better(plot["y"])


def plot_points(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The plot's points: the baseline, each format and each search trial with a size and a value
    of the plot's metric (MB, value, label, verdict, trial). A held-out gate is no point of its
    own: it judged the chosen trial's checkpoint, whose point is ringed."""
    metric = report["plot"]["y"]
    points = []
    for row in report["rows"]:
        value = row.get("metrics", {}).get(metric, {}).get("value")
        if search_role(row) != HELD_OUT and row.get("bytes") is not None and value is not None:
            points.append({"mb": row["bytes"] / 1e6, "value": value, "label": row["format"], "verdict": row["verdict"],
                           "trial": search_role(row) == TRIAL})
    return points


def plot_front(report: dict[str, Any]) -> list[tuple[float, float, str]]:
    """The Pareto front of the plot's points (baseline, formats, trials): the smallest checkpoint
    for each best value of the plot's metric, in order of size."""
    points = [(point["mb"], point["value"], point["label"]) for point in plot_points(report)]
    return pareto_front(points, _plot_higher_is_better(report))


def _held_out_mark(report: dict[str, Any]) -> tuple[str, str] | None:
    """(the chosen trial, its held-out verdict) where the search gated one on held-out items."""
    search = report.get("search") or {}
    held = search.get("held_out") or {}
    return (str(search["chosen"]), str(held["verdict"])) if search.get("chosen") and held.get("verdict") else None


def _plot_marker(point: dict[str, Any], cx: float, cy: float, front: bool) -> str:
    """A green dot (approved, the baseline grey), a red cross (blocked), a purple diamond (a
    search trial: filled, passed the search split; hollow, blocked on it)."""
    verdict = point["verdict"]
    classes = f"point {'trial ' if point['trial'] else ''}{verdict}{' front' if front else ''}"
    title = f"<title>{html.escape(point['label'])}: {point['mb']:.3f} MB, {point['value']:.4g}</title>"
    if point["trial"]:
        fill = TRIAL_COLOUR if verdict == "approved" else "#ffffff"
        return (f'<path class="{classes}" d="M{cx:.1f},{cy - 7:.1f} L{cx + 7:.1f},{cy:.1f} L{cx:.1f},{cy + 7:.1f} L{cx - 7:.1f},{cy:.1f} Z" '
                f'fill="{fill}" stroke="{TRIAL_COLOUR}" stroke-width="2">{title}</path>')
    colour = PLOT_COLOURS.get(verdict, "#57606a")
    if verdict == "blocked":
        return (f'<g class="{classes}">{title}<line x1="{cx - 6:.1f}" y1="{cy - 6:.1f}" x2="{cx + 6:.1f}" y2="{cy + 6:.1f}" stroke="{colour}" stroke-width="2.5"/>'
                f'<line x1="{cx - 6:.1f}" y1="{cy + 6:.1f}" x2="{cx + 6:.1f}" y2="{cy - 6:.1f}" stroke="{colour}" stroke-width="2.5"/></g>')
    return f'<circle class="{classes}" cx="{cx:.1f}" cy="{cy:.1f}" r="6" fill="{colour}">{title}</circle>'


# Where a point's label may go, tried in order until it overlaps no label placed before it:
# (dx, dy, text-anchor) from the point's centre.
_LABEL_SPOTS = ((9, -8, "start"), (9, 16, "start"), (-9, -8, "end"), (-9, 16, "end"), (9, -20, "start"), (-9, 28, "end"))


def _label_spots(anchors: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Each label's (x, y, text-anchor) beside its point (cx, cy, text), the first spot that
    overlaps no label placed so far (else the first), so that close points keep readable names."""
    placed: list[tuple[float, float, float, float]] = []
    spots = []
    for cx, cy, text in anchors:
        width = 6.8 * len(text)  # about the width of a 12-px sans-serif character
        choice = None
        for dx, dy, anchor in _LABEL_SPOTS:
            left = cx + dx if anchor == "start" else cx + dx - width
            box = (left, cy + dy - 11, left + width, cy + dy + 3)
            if not any(box[0] < other[2] and other[0] < box[2] and box[1] < other[3] and other[1] < box[3] for other in placed):
                choice = (box, (cx + dx, cy + dy, anchor))
                break
        if choice is None:
            dx, dy, anchor = _LABEL_SPOTS[0]
            choice = ((cx + dx, cy + dy - 11, cx + dx + width, cy + dy + 3), (cx + dx, cy + dy, anchor))
        placed.append(choice[0])
        spots.append(choice[1])
    return spots


def _plot_legend(margin: int, width: int, search: bool, held_out: str | None = None) -> list[str]:
    legend_y = margin - 25
    parts = [f'<circle cx="{margin + 10 + offset * 110}" cy="{legend_y}" r="5" fill="{colour}"/>'
             f'<text x="{margin + 20 + offset * 110}" y="{legend_y + 4}">{verdict}</text>'
             for offset, (verdict, colour) in enumerate(PLOT_COLOURS.items())]
    parts.append(f'<text x="{width - margin}" y="{legend_y + 4}" text-anchor="end" fill="#888">- - Pareto front</text>')
    if search:
        y, x = legend_y + 17, margin + 10
        parts.append(f'<path d="M{x},{y - 5} L{x + 5},{y} L{x},{y + 5} L{x - 5},{y} Z" fill="{TRIAL_COLOUR}"/>'
                     f'<text x="{x + 10}" y="{y + 4}">trial, passed the search split</text>'
                     f'<path d="M{x + 200},{y - 5} L{x + 205},{y} L{x + 200},{y + 5} L{x + 195},{y} Z" fill="#ffffff" stroke="{TRIAL_COLOUR}" stroke-width="1.5"/>'
                     f'<text x="{x + 210}" y="{y + 4}">trial, blocked</text>'
                     + ("" if held_out is None else
                        f'<circle cx="{x + 320}" cy="{y}" r="6" fill="none" stroke-width="2" '
                        + (f'stroke="{COLOURS[PASS]}"/>' if held_out == "approved" else f'stroke="{COLOURS[FAIL]}" stroke-dasharray="3 2"/>')
                        + f'<text x="{x + 332}" y="{y + 4}">{"approved" if held_out == "approved" else "blocked"} on held-out items</text>'))
    return parts


def svg_plot(report: dict[str, Any], width: int = 640, height: int = 400) -> str:
    """Size against the plot's metric: each format, the baseline and each search trial, the
    Pareto front as a step line (the best value at each size), the checkpoint the search's
    held-out gate approved ringed in green (blocked: a dashed red ring)."""
    metric = report["plot"]["y"]
    points = plot_points(report)
    margin = 60
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"><text x="20" y="40">no data for {html.escape(metric)}</text></svg>'
    xs, ys = [p["mb"] for p in points], [p["value"] for p in points]
    x0, x1 = 0.0, max(xs) * 1.1
    y_pad = (max(ys) - min(ys)) * 0.15 or abs(max(ys)) * 0.05 or 1.0
    y0, y1 = min(ys) - y_pad, max(ys) + y_pad
    def sx(x: float) -> float:
        return margin + (x - x0) / (x1 - x0) * (width - 2 * margin)

    def sy(y: float) -> float:
        return height - margin - (y - y0) / (y1 - y0) * (height - 2 * margin)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" id="size-accuracy" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" y2="{height - margin}" stroke="#333"/>',
             f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" stroke="#333"/>',
             f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">checkpoint size (MB)</text>',
             f'<text x="15" y="{height / 2}" text-anchor="middle" transform="rotate(-90 15 {height / 2})">{html.escape(metric)}</text>']
    digits = 0 if x1 >= 10 else 1 if x1 >= 1 else 2
    for step in range(5):
        xv, yv = x0 + (x1 - x0) * step / 4, y0 + (y1 - y0) * step / 4
        parts.append(f'<text x="{sx(xv):.1f}" y="{height - margin + 16}" text-anchor="middle">{xv:.{digits}f}</text>')
        parts.append(f'<text x="{margin - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.3f}</text>')
    front = plot_front(report)
    if len(front) > 1:  # a step line: each point's value holds until the next, larger one betters it
        corners = [front[0][:2]] + [corner for (_, y_prev, _), (x, y, _) in zip(front, front[1:], strict=False)
                                    for corner in ((x, y_prev), (x, y))]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in corners)
        labels = ", ".join(label for _, _, label in front)
        parts.append(f'<polyline class="pareto" points="{path}" fill="none" stroke="#888" stroke-dasharray="4 3">'
                     f'<title>Pareto front: {html.escape(labels)}</title></polyline>')
    on_front = {label for _, _, label in front}
    mark = _held_out_mark(report)
    spots = _label_spots([(sx(point["mb"]), sy(point["value"]), point["label"]) for point in points])
    for point, (lx, ly, anchor) in zip(points, spots, strict=True):
        cx, cy = sx(point["mb"]), sy(point["value"])
        if mark is not None and point["label"] == mark[0]:
            state = "approved" if mark[1] == "approved" else "blocked"
            stroke = f'stroke="{COLOURS[PASS]}"' if state == "approved" else f'stroke="{COLOURS[FAIL]}" stroke-dasharray="3 2"'
            parts.append(f'<circle class="held-out-{state}" cx="{cx:.1f}" cy="{cy:.1f}" r="12" fill="none" {stroke} stroke-width="2.5">'
                         f'<title>{html.escape(mark[0])}: {state} on held-out items</title></circle>')
        parts.append(_plot_marker(point, cx, cy, point["label"] in on_front))
        end = ' text-anchor="end"' if anchor == "end" else ""
        parts.append(f'<text x="{lx:.1f}" y="{ly:.1f}"{end}>{html.escape(point["label"])}</text>')
    parts += _plot_legend(margin, width, any(point["trial"] for point in points), None if mark is None else mark[1])
    parts.append("</svg>")
    return "".join(parts)


# ---- the per-layer sensitivity chart ---------------------------------------------------------------

SERIES_COLOURS = ("#0969da", "#bc4c00", TRIAL_COLOUR, "#1a7f37", "#cf222e", "#57606a")
UNQUANTIZED_COLOUR = "#d0d7de"  # a group the allocation left at 16 bits


def _decades(scores: list[float]) -> tuple[int, int]:
    """The log10 range of the positive scores, whole decades (at least one)."""
    positive = [score for score in scores if _finite(score) and score > 0]
    if not positive:
        return -1, 0
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    return low, max(high, low + 1)


def _block_ticks(groups: list[dict[str, Any]]) -> list[tuple[int, int, Any]]:
    """(first group index, last group index, block) for each run of groups of one block."""
    runs: list[tuple[int, int, Any]] = []
    for index, group in enumerate(groups):
        if runs and runs[-1][2] == group.get("block"):
            runs[-1] = (runs[-1][0], index, runs[-1][2])
        else:
            runs.append((index, index, group.get("block")))
    return runs


def sensitivity_svg(sensitivity: dict[str, Any], allocation: tuple[str, dict[str, str]] | None = None,
                    width: int = 960, height: int = 360) -> str:
    """Each layer group's score per format (`<g class="series">` per format, one point per group),
    groups across in model order under their decoder block's index, scores up on a log scale; a
    strip under the axis (`allocation`: a trial's name and its group -> format) shows which format
    that trial gave each group."""
    groups, formats = list(sensitivity.get("groups") or []), list(sensitivity.get("formats") or [])
    colours = {fmt: SERIES_COLOURS[index % len(SERIES_COLOURS)] for index, fmt in enumerate(formats)}
    left, right, top = 78, 16, 44
    strip = 26 if allocation else 0
    bottom = 52 + strip
    plot_w, plot_h = width - left - right, height - top - bottom
    low, high = _decades([float(group["scores"].get(fmt, 0.0)) for group in groups for fmt in formats])
    count = max(1, len(groups))

    def gx(index: int) -> float:
        return left + (index + 0.5) * plot_w / count

    def gy(score: float) -> float:
        level = math.log10(score) if _finite(score) and score > 0 else low  # zero: on the floor
        return top + plot_h - (min(max(level, low), high) - low) / (high - low) * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="sensitivity" id="sensitivity" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" role="img" '
             f'aria-label="per-layer-group sensitivity, one series per format">',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#d0d7de"/>']
    step = 1 if high - low <= 8 else 2
    for decade in range(low, high + 1, step):
        y = top + plot_h - (decade - low) / (high - low) * plot_h
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#eaeef2"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">1e{decade}</text>')
    runs = _block_ticks(groups)
    every = max(1, math.ceil(len(runs) / 24))  # at most about 24 block labels
    for position, (first, last, block) in enumerate(runs):
        x = left + first * plot_w / count
        if first:
            parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" stroke="#eaeef2"/>')
        if position % every == 0:
            label = "–" if block is None else str(block)
            parts.append(f'<text x="{(gx(first) + gx(last)) / 2:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{label}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">decoder block (its layer groups in model order)</text>')
    unit = str(sensitivity.get("unit") or "score")
    parts.append(f'<text x="16" y="{top + plot_h / 2}" text-anchor="middle" transform="rotate(-90 16 {top + plot_h / 2})">'
                 f'{html.escape(unit.split(" (")[0])}, log scale</text>')
    for fmt in formats:
        colour = colours[fmt]
        coords = [(gx(index), gy(float(group["scores"].get(fmt, 0.0)))) for index, group in enumerate(groups)]
        parts.append(f'<g class="series" data-format="{html.escape(fmt)}">'
                     f'<polyline points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in coords)}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for (x, y), group in zip(coords, groups, strict=True):
            score = float(group["scores"].get(fmt, 0.0))
            parts.append(f'<circle class="score" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour if score > 0 else "#ffffff"}" stroke="{colour}">'
                         f'<title>{html.escape(str(group.get("name", "?")))}, {html.escape(fmt)}: {score:.3g}</title></circle>')
        parts.append("</g>")
    for index, fmt in enumerate(formats):
        x = left + index * 230
        total = (sensitivity.get("totals") or {}).get(fmt)
        parts.append(f'<rect x="{x}" y="14" width="14" height="4" fill="{colours[fmt]}"/><text x="{x + 20}" y="20">'
                     f'{html.escape(fmt)}{f" (total {total:.3g})" if _finite(total) else ""}</text>')
    if allocation:
        name, choice = allocation
        y = top + plot_h + 24
        parts.append(f'<text x="{left - 6}" y="{y + 11}" text-anchor="end">{html.escape(name)}</text><g class="allocation">')
        for index, group in enumerate(groups):
            fmt = choice.get(str(group.get("name")))
            x = left + index * plot_w / count
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max(plot_w / count - 1, 0.5):.1f}" height="14" '
                         f'fill="{colours.get(fmt or "", UNQUANTIZED_COLOUR)}"><title>{html.escape(str(group.get("name")))}: '
                         f'{html.escape(fmt or "not searched")}</title></rect>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _html_table(header: list[str], rows: list[list[str]], *, table_id: str = "", table_class: str = "",
                row_classes: list[str] | None = None, numeric: set[int] | None = None) -> str:
    """A table of cells already escaped; a cell that is a whole `<td ...>` element is kept as is,
    the columns in `numeric` are right-aligned."""
    numeric = numeric or set()
    align = ' class="n"'

    def cell_html(index: int, cell: str) -> str:
        return cell if cell.startswith("<td") else f"<td{align if index in numeric else ''}>{cell}</td>"

    head = "".join(f"<th{align if index in numeric else ''}>{html.escape(cell)}</th>" for index, cell in enumerate(header))
    body = []
    for position, cells in enumerate(rows):
        row_class = f' class="{html.escape(row_classes[position])}"' if row_classes else ""
        body.append(f"<tr{row_class}>" + "".join(cell_html(index, cell) for index, cell in enumerate(cells)) + "</tr>")
    attributes = (f' id="{table_id}"' if table_id else "") + (f' class="{table_class}"' if table_class else "")
    return f"<table{attributes}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _formats_table(report: dict[str, Any]) -> str:
    """The main table; each candidate's name links to its section."""
    header, rows = table(report)
    cells_out = []
    for row, cells in zip(report["rows"], rows, strict=True):
        name = html.escape(cells[0])
        link = name if row["verdict"] == "baseline" else f'<a href="#candidate-{name}">{name}</a>'
        if search_role(row):  # a search row: its mix under its name
            link += f'<br><span class="muted mix">{html.escape(mix_text(row["search"].get("groups_by_format") or {}))}</span>'
        note = _verdict_note(row)
        verdict = f'<td class="verdict"><b>{html.escape(cells[-2])}</b>' + (f' <span class="muted">{html.escape(note)}</span>' if note else "") + "</td>"
        # the items per set: each set's count kept on one line, the list wrapping between sets
        items = ", ".join(f'<span class="nowrap">{html.escape(part)}</span>' for part in cells[-1].split(", "))
        cells_out.append([f"<td>{link}</td>", *(html.escape(cell) for cell in cells[1:-2]), verdict, f'<td class="items">{items}</td>'])
    numeric = set(range(1, len(header) - 2))
    return _html_table(header, cells_out, table_id="formats", row_classes=[row_class(row) for row in report["rows"]], numeric=numeric)


def row_class(row: dict[str, Any]) -> str:
    """The row's class in the formats table, its badge's: the verdict ('approved', 'blocked',
    'baseline'); a trial 'trial passed' or 'trial blocked' (never 'approved'); a held-out gate
    'held-out approved' or 'held-out blocked'."""
    role = search_role(row)
    if role == TRIAL:
        return "trial passed" if row["verdict"] in ("approved", PENDING) else "trial blocked"
    return f"held-out {row['verdict']}" if role == HELD_OUT else str(row["verdict"])


def _candidate_section(row: dict[str, Any], profiles: list[str]) -> str:
    name = html.escape(row["format"])
    parts = [f'<section class="candidate" id="candidate-{name}">',
             f'<h3>{name} <span class="badge {html.escape(row_class(row))}">{html.escape(verdict_text(row))}</span></h3>',
             f'<p class="facts">{html.escape(facts_sentence(row, profiles))}</p>']
    if search_role(row):
        parts.append(f'<p class="search-note">{html.escape(search_note(row))}</p>')
    if row["verdict"] == "blocked":
        parts.append(f'<p class="why">{html.escape(blocked_sentence(row))}</p>')
    parts.append(forest_svg(row))
    gates = _gates(row)
    if gates:
        rows = []
        for gate in gates:
            cells = [html.escape(cell) for cell in gate_cells(gate)]
            outcome = str(gate.get("outcome", ""))
            cells[1] = f'<td class="outcome" style="color: {COLOURS.get(outcome, COLOURS[NOT_EVALUATED])}">{cells[1]}</td>'
            cells[-1] = f'<td class="reason">{cells[-1]}</td>'
            rows.append(cells)
        parts.append(_html_table(GATE_HEADER, rows, table_class="gates", row_classes=["gate"] * len(rows),
                                 numeric={2, 3, 4, 5, 7, 8, 9, 10}))
        parts.append(_stability_html(row))
    elif row.get("reasons"):
        parts.append("<ul>" + "".join(f"<li>{html.escape(reason)}</li>" for reason in row["reasons"]) + "</ul>")
    tails = tail_cells(row)
    if tails:
        rows = [[f'<td>{html.escape(name)}' + (f'<br><span class="muted">{items:,} items</span>' if items is not None else "") + "</td>"]
                + [f'<td class="n">{html.escape(value)}' + (f'<br><span class="ci">{html.escape(interval)}</span>' if interval else "") + "</td>"
                   for value, interval in cells] for name, items, cells in tails]
        parts.append(f'<h4>Tails of the per-token KL</h4><p class="muted note">{html.escape(tails_note(row))}</p>')
        parts.append(_html_table(TAIL_HEADER, rows, table_class="tails", numeric=set(range(1, len(TAIL_HEADER)))))
    skipped = _not_evaluated(row)
    if skipped:
        parts.append('<p class="muted">Not evaluated:</p><ul class="not-evaluated">'
                     + "".join(f"<li>{html.escape(line)}</li>" for line in skipped) + "</ul>")
    parts.append("</section>")
    return "\n".join(parts)


def _stability_html(row: dict[str, Any]) -> str:
    """A candidate's verdict stability: the bars and the lines flagging the unstable gates."""
    lines = stability_lines(row)
    if not lines:
        return ""
    flagged = bool(unstable_gates(row))
    items = "".join(f'<li>{html.escape(line)}</li>' for line in lines)
    return (f'<h4>Verdict stability</h4>{stability_svg(row)}'
            f'<ul class="stability{" unstable" if flagged else ""}">{items}</ul>')


# Sized for a 1280-pixel window: the body is at most 1200 px wide, tables wrap their text
# (the reasons) rather than widen, and SVGs shrink with the page.
STYLE = """
body { font-family: sans-serif; color: #1f2328; max-width: 1200px; margin: 0 auto; padding: 1em 1.5em 3em; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #d0d7de; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.gates { width: 100%; font-size: 12px; }
table.gates td.reason { overflow-wrap: anywhere; min-width: 15em; }
table.gates td:first-child, table.gates td:nth-child(7) { white-space: nowrap; }
tr.approved td.verdict b, .badge.approved { color: #1a7f37; }
tr.blocked td.verdict b, .badge.blocked { color: #cf222e; }
tr.passed td.verdict b, .badge.passed { color: #8250df; }
tr.pending td.verdict b, .badge.pending, li.pending { color: #9a6700; }
#formats .mix { font-size: 11px; }
#search-trials td:last-child { overflow-wrap: anywhere; min-width: 14em; }
#held-out.approved b { color: #1a7f37; } #held-out.blocked b { color: #cf222e; }
.badge { font-size: 0.75em; border: 1px solid currentColor; border-radius: 1em; padding: 0 0.6em; vertical-align: middle; }
.muted { color: #59636e; }
#summary li { margin: 0.25em 0; }
section.candidate { margin-top: 1.5em; }
section.candidate h3 { margin-bottom: 0.2em; }
svg { max-width: 100%; height: auto; display: block; }
svg.forest { margin: 0.6em 0; }
svg.forest text { font-variant-numeric: tabular-nums; }
.nowrap { white-space: nowrap; }
#formats td.items { max-width: 16em; }
section.candidate h4 { margin: 1em 0 0.2em; }
p.note { font-size: 13px; margin: 0.2em 0 0.4em; }
table.tails { font-size: 12px; }
table.tails .ci { color: #59636e; font-size: 11px; }
ul.stability.unstable li { color: #cf222e; }
"""


def _plot_note(report: dict[str, Any]) -> str:
    if not report.get("search"):
        return ""
    return ('\n<p class="muted note">The search\'s trials are purple diamonds (filled: passed the search split; hollow: blocked on it), '
            "their values on the search split; the checkpoint approved on held-out items is ringed in green (blocked there: a dashed "
            "red ring). The Pareto front is the step line through the points no other point beats: no larger and no worse.</p>")


def _search_section(report: dict[str, Any]) -> str:
    """The search: its conclusion, the held-out verdict and its items, the trials, the repeats,
    and the per-layer sensitivity chart."""
    search = report.get("search")
    if not search:
        return ""
    held = (search.get("held_out") or {}).get("verdict")
    held_class = "approved" if held == "approved" else "blocked"
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in search_lines(report))
    trials = search_table(report)
    rows = [[html.escape(cell) for cell in cells] for cells in trials]
    for cells, trial in zip(rows, search.get("trials") or [], strict=False):
        colour = TRIAL_COLOUR if trial.get("verdict") == "approved" else COLOURS[FAIL]
        cells[5] = f'<td style="color: {colour}">{cells[5]}</td>'
    parts = ['\n<h2 id="search">Mixed-precision search</h2>',
             f'<p id="search-conclusion"><b>{html.escape(conclusion_sentence(report))}</b></p>',
             f'<p id="held-out" class="{held_class}"><b>Held-out gate:</b> {html.escape(held_out_sentence(report))}</p>',
             f"<ul>{lines}</ul>"]
    if rows:
        parts.append(_html_table(SEARCH_HEADER, rows, table_id="search-trials", numeric={1, 2, 3}))
    if report.get("sensitivity"):
        parts += ["<h3>Per-layer sensitivity</h3>", sensitivity_svg(report["sensitivity"], _allocation(report)),
                  f'<p class="muted note" id="sensitivity-caption">{html.escape(sensitivity_caption(report))}</p>']
    return "\n".join(parts)


def serving_class_sentences(report: dict[str, Any]) -> list[str]:
    """Per served checkpoint, the device class and kernels it was served with, and where the
    engine's default would have served another scheme, what and how far from gated."""
    sentences = []
    for row in report["rows"]:
        serving = row.get("serving") or {}
        if not serving.get("device_class"):
            continue
        served_as = ", ".join(f"{entry['scheme']} as {entry['served_as']}" for entry in serving.get("schemes") or [])
        kernels = "; ".join(serving.get("kernels") or []) or "no kernel line in its log"
        name = display_name(row) if row["verdict"] != "baseline" else "baseline"
        sentences.append(f"{name} on {serving['device_class']}: {served_as or 'unquantized'} (kernels: {kernels}).")
        default = engine_default_sentence(row)
        if default:
            sentences.append(default)
        for device_class, entry in (row.get("classes") or {}).items():
            sentences += [f"{name} on {device_class}, {as_served_text(gated)}." for gated in entry.get("as_served") or []]
    return sentences


def _serving_section(report: dict[str, Any]) -> str:
    """The serve stage's table (served, agreement, decode tokens/s), a failure's reason in red."""
    header, rows = serving_table(report)
    if not rows:
        return ""
    cells = [[html.escape(cell) for cell in row] for row in rows]
    for row in cells:
        if row[1].startswith("no"):
            row[1] = f'<td style="color: {COLOURS[FAIL]}">{row[1]}</td>'
    classes = "".join(f"<li>{html.escape(sentence)}</li>" for sentence in serving_class_sentences(report))
    return "\n".join(['\n<h2 id="serving">Served in vLLM</h2>', _html_table(header, cells, table_id="served", numeric={2, 3, 4, 6, 7}),
                      f'<ul id="serving-classes">{classes}</ul>' if classes else "",
                      f'<p class="muted note">{html.escape(serving_note(report))}</p>'])


def html_page(report: dict[str, Any]) -> str:
    profiles = [profile["name"] for profile in report["hardware"]]
    recommendations = "".join(f"<li>{html.escape(sentence)}</li>" for sentence in recommendation_sentences(report))
    blocked = "".join(f"<li>{html.escape(blocked_sentence(row))}</li>" for row in report["rows"]
                      if row["verdict"] == "blocked" and search_role(row) != TRIAL)
    blocked += "".join(f'<li class="pending">{html.escape(pending_sentence(row))}</li>' for row in report["rows"]
                       if row["verdict"] == PENDING and search_role(row) != TRIAL)
    searched = "".join(f"<li>{html.escape(sentence)}</li>" for sentence in search_sentences(report))
    searched_html = f'\n<ul id="search-summary">{searched}</ul>' if searched else ""
    candidates = "\n".join(_candidate_section(row, profiles) for row in report["rows"] if row["verdict"] != "baseline")
    context = "".join(f"<li>{html.escape(line)}</li>" for line in context_lines(report))
    measured_header, measured_rows = measured_table(report)
    measured = "" if not measured_rows else _html_table(
        measured_header, [[html.escape(cell) for cell in cells] for cells in measured_rows], table_id="measured",
        numeric=set(range(3, len(measured_header))))
    narrowed = narrowed_sentence(report)
    narrowed_html = f'\n<p id="narrowed">{html.escape(narrowed)}</p>' if narrowed else ""
    model = html.escape(report["model"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>quantgate report: {model}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{STYLE}</style></head><body>
<h1>quantgate report: {model}</h1>
<p class="muted" id="policy">{html.escape(policy_line(report))}</p>
<section id="summary"><h2>Summary</h2>
<ul id="recommendation">{recommendations}</ul>
<p>{html.escape(approved_sentence(report))}</p>{searched_html}{narrowed_html}
<ul id="blocked">{blocked}</ul></section>
<h2>Formats</h2>
{_formats_table(report)}
<p class="muted">MB: checkpoint bytes / 10<sup>6</sup>. bits/weight: the quantized layers' (the baseline: its whole model's).
b1 ms: the decode-step lower bound at batch 1 (batch 32 in each candidate's section). items: golden-set items evaluated, per set
as far as the format's looks went (the baseline: as deep as any format, paired item by item; see What was measured).</p>
<h2>Size against {html.escape(report['plot']['y'])}</h2>
{svg_plot(report)}{_plot_note(report)}{_search_section(report)}{_serving_section(report)}
<h2>Candidates</h2>
<p class="muted">Each forest plot has one row per metric gate, each on its own scale: the gate's limit is the dark mark in the
middle, the worse side is to the right (tinted), the line is the interval and the dot the estimate; green passed, red failed,
amber insufficient evidence, grey not evaluated. The numbers are beside each row and in the table below it; under that, the
tails of the per-token KL of each text set, gated or not.</p>
{candidates}
<h2>What was measured</h2><ul>{context}</ul>
{measured}
</body></html>
"""


def write(report: dict[str, Any], out: Path, overwrite: bool = True) -> Path:
    """Write report.json, report.md and report.html into `out` atomically."""
    report = {**report, "schema_version": SCHEMA_VERSION,
              "recommendation": {p["name"]: recommendation(report["rows"], p["name"]) for p in report["hardware"]},
              "measured_recommendation": measured_recommendation(report["rows"])}
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        (staging / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (staging / "report.md").write_text(markdown(report), encoding="utf-8")
        (staging / "report.html").write_text(html_page(report), encoding="utf-8")
    return Path(out)


# ---- a report from a run directory (`quantgate run`, `quantgate report RUN_DIR`) ------------

def _row(name: str, measured: dict[str, Any] | None, results: dict[str, Any] | None, verdict: dict[str, Any] | None,
         columns: list[str], sequential: dict[str, Any] | None = None) -> dict[str, Any]:
    measurement = (measured or {}).get("measurement")
    metrics: dict[str, Any] = {}
    for column in columns:
        gate_id = GateId.parse(column)
        facts = METRICS.get(gate_id.check)  # None: a metric newer than this table (a value, not a change)
        value = (results or {}).get("sets", {}).get(gate_id.scope, {}).get("metrics", {}).get(gate_id.check)
        gate = (verdict or {}).get("metrics", {}).get(column)
        if verdict is None and results is not None and value is None and facts is not None:
            value = facts.baseline_value  # the baseline against itself (agreement metrics)
        entry: dict[str, Any] = {"value": value}
        if gate is not None:
            if facts is not None and facts.is_change:
                entry.update(difference=gate["estimate"], low=gate["low"], high=gate["high"], unit=gate["unit"])
            else:
                entry.update(value=gate["estimate"], low=gate["low"], high=gate["high"], unit=gate["unit"])
            entry["outcome"] = gate["outcome"]
        metrics[column] = entry
    kl = next((entry["value"] for column, entry in metrics.items() if GateId.parse(column).check == "kl_divergence"), None)
    if kl is None and results is not None:
        kl = next((entry["metrics"].get("kl_divergence") for entry in results.get("sets", {}).values()
                   if "kl_divergence" in entry.get("metrics", {})), None)
    return {
        "format": name,
        "bytes": measurement["totals"]["file_bytes"] if measurement else None,
        "bits_per_weight_layers": measurement["quantized_linear"]["bits_per_weight"]["measured"] if measurement else None,
        "bits_per_parameter": measurement["whole_model"]["bits_per_parameter"]["measured"] if measurement else None,
        # the baseline is measured on its own; each format against it
        "ratio_to_baseline": None if not measurement else 1.0 if verdict is None else measurement["baseline"]["ratio_total"],
        "bounds": {profile: {"batch1_ms": entry["batch1_ms"], "batch32_ms": entry["batch32_ms"]}
                   for profile, entry in ((measured or {}).get("bounds") or {}).items()},
        "metrics": metrics,
        "kl_divergence": kl,
        "verdict": "baseline" if verdict is None else verdict["verdict"],
        "reasons": [] if verdict is None else verdict["reasons"],
        # every gate with its numbers (GateResult.as_dict), and the sets fail fast left out;
        # verdict records from before either was written have neither
        "gates": [] if verdict is None else list(verdict.get("gates") or []),
        "not_evaluated": {} if verdict is None else dict(verdict.get("not_evaluated") or {}),
        # its looks: per set the looks planned and the items evaluated (`items`), what stopped them;
        # None for the baseline, a format that failed to quantize, and verdicts from before looks
        "sequential": sequential,
        # per text set the per-token KL's tails with bootstrap intervals, gated or not
        "tails": {} if verdict is None else dict(verdict.get("tails") or {}),
        # a search's trial or held-out gate: its role, split, items, mix (gates.report.build); None otherwise
        "search": None,
        # its serve check (evalsets.served.served_summary): served by vLLM or not, the agreement with
        # what was gated, decode tokens/s and the bound; None where the run had no serve stage
        "serving": None if verdict is None else verdict.get("serving"),
        # per device class: approved, pending (with the command that attests it) or blocked
        "classes": {} if verdict is None else dict(verdict.get("classes") or {}),
    }


def _sequential(verdict: dict[str, Any], artifact: dict[str, Any] | None) -> dict[str, Any] | None:
    """A format's looks: the verdict's `sequential` record, else (a verdict written before it
    recorded them) its sequential stage's value, in the same shape. A format with no results of
    its own (it failed to quantize) has none: a sequential artifact left there is another run's."""
    if isinstance(verdict.get("sequential"), dict):
        return dict(verdict["sequential"])
    if artifact is None or verdict.get("results") is None or not isinstance(artifact.get("depths"), dict):
        return None
    return {"looks": artifact.get("looks") or {}, "items": artifact["depths"], "error_control": artifact.get("error_control"),
            "confidence": artifact.get("confidence"), "blocked_by": artifact.get("blocked_by"),
            "not_evaluated": dict(verdict.get("not_evaluated") or {}), "trace": artifact.get("trace") or []}


def _policy(run: dict[str, Any], verdicts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run's policy identity, narrowed (`narrowed_to`, `dropped`) where the run's record or
    any verdict says so."""
    policy = {key: run["policy"][key] for key in ("name", "version", "sha256")}
    sources = [run["policy"], *(verdict.get("policy") or {} for verdict in verdicts.values())]
    narrowed = next((source for source in sources if source.get("narrowed_to") is not None), None)
    if narrowed is not None:
        policy.update(narrowed_to=list(narrowed["narrowed_to"]), dropped=list(narrowed.get("dropped") or []))
    return policy


def build(run_dir: Path) -> dict[str, Any]:
    """The report's data from a run directory's artifacts (run.json, measure/, results/, verdicts/)."""
    layout = RunDir(Path(run_dir))
    run_dir = layout.root
    run_file = layout.run_file
    if not run_file.is_file():
        raise InputError(f"{run_dir} is not a quantgate run directory (no run.json)")
    run = read_json(run_file)
    if run.get("kind") != RUN_KIND:
        raise InputError(f"{run_file} is not the record of a quantgate run")

    def manifest(directory: Path) -> dict[str, Any] | None:
        path = directory / MANIFEST
        return read_json(path) if path.is_file() else None

    search = _search_record(layout, run)
    names = list(run["formats"]) + _search_names(search)  # the formats, then the search's trials and its held-out gate
    stored = {name: stored_value(layout.verdict(name)) for name in names}
    missing = [name for name, verdict in stored.items() if verdict is None]
    verdicts = {name: verdict for name, verdict in stored.items() if verdict is not None}
    if missing:
        raise InputError(f"the run in {run_dir} has no verdict yet for {', '.join(missing)}: run it to the end first")
    columns: list[str] = []  # every metric gate, in policy order (a format that failed to quantize has none)
    for verdict in verdicts.values():
        columns += [gate for gate in verdict["metrics"] if GateId.parse(gate).on_golden_set and gate not in columns]
    baseline_results = manifest(layout.results(BASELINE))
    baseline_measured = stored_value(layout.measure(BASELINE)) or {}
    rows = [_row("baseline", baseline_measured, baseline_results, None, columns)]
    baseline_served = stored_value(layout.serve(BASELINE))
    rows[0]["serving"] = served_summary(baseline_served) if baseline_served else None
    artifacts = {name: stored_value(layout.sequential(name)) for name in names}
    sequential = {name: _sequential(verdicts[name], artifacts[name]) for name in names}
    for name in names:
        # a held-out gate judged its trial's checkpoint: measured once, under the trial's name
        checkpoint = name if name in run["formats"] else str(verdicts[name].get("checkpoint_name") or name.split("@")[0])
        row = _row(name, stored_value(layout.measure(checkpoint)), manifest(layout.results(name)), verdicts[name], columns,
                   sequential=sequential[name])
        if search is not None and name not in run["formats"]:
            row["search"] = _search_info(search, checkpoint, verdicts[name])
        rows.append(row)
    # each set's looks (item counts, the last its ceiling): the run's record, else any format's
    looks: dict[str, list[int]] = dict(run.get("looks") or {})
    for entry in sequential.values():
        for spec, counts in ((entry or {}).get("looks") or {}).items():
            looks.setdefault(spec, list(counts))
    calibration = manifest(layout.calibration)
    any_bounds = next(iter((baseline_measured.get("bounds") or {}).values()), None)
    plot = dict(run["plot"])
    if plot.get("y") not in columns and columns:
        plot.update(y=columns[0], higher_is_better=_column_higher_is_better(columns[0]))
    return {
        "model": run["plan"]["model"],
        "model_path": run["model"],
        "policy": _policy(run, verdicts),
        "hardware": [{"name": name} for name in run["hardware"]],
        "metric_columns": columns,
        "plot": plot,
        "rows": rows,
        # the baseline's results: each set at its first look (`items`); `looks` as the run planned them
        "evalsets": [{"spec": spec, "items": entry["items"], "limit": entry["limit"], "sha256": entry["sha256"],
                      "size": _set_size(spec), "looks": list(looks.get(spec) or [])}
                     for spec, entry in (baseline_results or {}).get("sets", {}).items()],
        "calibration": None if calibration is None else {
            "samples": calibration["samples"], "seq_len": calibration["seq_len"], "fingerprint": calibration["fingerprint"],
            "source": calibration["config"]["source"]},
        "bounds_inputs": None if any_bounds is None else {"context_tokens": any_bounds["context_tokens"],
                                                          "kv_bytes_per_element": any_bounds["kv_bytes_per_element"]},
        "confidence": run.get("confidence", 0.95),
        "ledger": run.get("ledger"),
        # the search's record (search.json) and its layer groups' sensitivity; None without a search
        "search": search,
        "sensitivity": None if search is None else _sensitivity(layout),
    }


def _search_record(layout: RunDir, run: dict[str, Any]) -> dict[str, Any] | None:
    """search.json of a run whose plan has a search (a record another plan left is not this run's)."""
    if (run.get("plan") or {}).get("search") is None or not layout.search_file.is_file():
        return None
    record: dict[str, Any] = read_json(layout.search_file)
    return record


def _search_names(search: dict[str, Any] | None) -> list[str]:
    """The verdicts a search left: each trial's, then the chosen trial's held-out gate's."""
    if search is None:
        return []
    names = [str(trial["name"]) for trial in search.get("trials") or []]
    return names + ([f"{search['chosen']}@held-out"] if search.get("chosen") and search.get("held_out") else [])


def _search_info(search: dict[str, Any], checkpoint: str, verdict: dict[str, Any]) -> dict[str, Any]:
    """A search row's `search`: its role, by the split its verdict was reached on (only a
    held-out verdict can approve; any other split is a trial's), and its trial's allocation."""
    trial: dict[str, Any] = next((entry for entry in search.get("trials") or [] if entry.get("name") == checkpoint), {})
    return {"role": HELD_OUT if verdict.get("split") == "held-out" else TRIAL, "checkpoint": checkpoint,
            "split": verdict.get("split"), "split_items": dict(verdict.get("split_items") or {}),
            "groups_by_format": dict(trial.get("groups_by_format") or {}), "groups": (search.get("space") or {}).get("groups"),
            "budget_ratio": trial.get("budget_ratio"), "predicted_cost": trial.get("predicted_cost"),
            "chosen": checkpoint == search.get("chosen")}


def _sensitivity(layout: RunDir) -> dict[str, Any] | None:
    """The chart's data from sensitivity/sensitivity.json (quantize.sensitivity's report; read
    here, not through that module, which imports torch): the method, the unit, each group's
    scores, the rank check's Spearman rho per format where it ran."""
    path = layout.sensitivity() / "sensitivity.json"
    if not path.is_file():
        return None
    data = read_json(path)
    validation = (data.get("validation") or {}).get("formats") or {}
    return {**{key: data.get(key) for key in ("method", "formula", "unit", "fisher", "tokens", "formats", "totals")},
            "groups": [{key: group.get(key) for key in ("name", "block", "role", "parameters", "scores")} for group in data.get("groups") or []],
            "spearman": {fmt: entry.get("spearman") for fmt, entry in validation.items() if isinstance(entry, dict)}}


def _set_size(spec: str) -> int | None:
    try:
        return evalsets.load(spec).size
    except InputError:
        return None
