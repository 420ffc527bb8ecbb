"""The serve record as a record: what `evalsets.served.check` returns, `quantgate serving check`
writes to serve.json and the serve stage keeps in serve/<name>.json; and `ServedSummary`, what a
verdict, a serving ledger record and the report keep of it (docs/serving.md, "The serve record").

A serve record holds only what its check reached: a checkpoint not served has no agreement, no
throughput; one compared with no gated results says why (`not_compared`) instead of `gated`.
Those fields are absent from the JSON, not null, and read back as None: `to_json` writes the
fields that were set, so a record read and written again is the same bytes.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import JsonValue

from quantgate.core.records import Record, RecordPart

KIND: Final = "serve"
# 3: the record names its kind (2 had no `kind`); the fields are those of 2
SCHEMA_VERSION: Final = 3
Status = Literal["served", "pending", "not_served", "failed"]


class _Sparse(RecordPart):
    """A part whose fields not reached are absent from its JSON (see the module docstring)."""

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class ServeMachine(RecordPart):
    """The machine a decode rate was measured on (evalsets.served.machine)."""

    cpu: str
    cores: int | None
    system: str


class SchemeServed(_Sparse):
    """A scheme the checkpoint asks for and the scheme the engine computes for it under the
    settings the check ran with (`served_as`: read from the kernel the engine logged where its
    log decides it, else what serving.device.RULES expect), and under the engine's defaults (the
    rules' expectation); `expected`: what the rules expect under the check's settings; `kernel`,
    `evidence`: the kernel vLLM selected and what the scheme rests on; `mismatch`: the log shows
    another scheme than the rules expect (serving.device.scheme_mismatch)."""

    scheme: str
    served_as: str
    engine_default: str
    expected: str | None = None
    kernel: str | None = None
    evidence: str | None = None
    mismatch: str | None = None


class GatedSide(RecordPart):
    """The gated results the served log-probabilities were compared with."""

    results: str
    results_sha256: str
    evalset: str
    items: int
    tokens: int
    weights_sha256: str
    weights_match: bool  # the served checkpoint's weights and config are those the results were computed on


class Probe(_Sparse):
    """The timed probe: the worker's answer (`prompt_tokens`), or why it stopped (`reason`, the
    limits; `log`: a stop that was tried again keeps its worker's log there)."""

    forward_seconds: list[float]
    kind: str | None = None
    seconds: float | None = None
    prompt_tokens: int | None = None
    reason: str | None = None
    limit_seconds: float | None = None
    warmup_limit_seconds: float | None = None
    log: str | None = None


class ItemNLL(RecordPart):
    tokens: int
    nll_served: float
    nll_gated: float


class Agreement(_Sparse):
    """Served against gated, position by position over the compared items (nats)."""

    positions: int
    items: int
    evalset: str
    nll_served: float
    nll_gated: float
    nll_change: float
    mean_abs_logprob_difference: float
    p99_abs_logprob_difference: float
    max_abs_logprob_difference: float
    kl_served_gated_mean: float
    kl_served_gated_p99: float
    top1_agreement: float
    per_item: list[ItemNLL] | None = None  # the serve record's own; a summary's and an engine default's leave it out

    def kept(self) -> Agreement:
        """The agreement without its per-item numbers."""
        return Agreement(**{key: getattr(self, key) for key in self.model_fields_set if key != "per_item"})


class Greedy(RecordPart):
    """Greedy continuations, served against gated, token by token."""

    prompts: int
    tokens: int
    identical: int
    matched_tokens: list[int]
    mean_matched_fraction: float


class EngineDefault(_Sparse):
    """What the engine's default settings would serve on this class, where serving.device.RULES
    expect them to compute another scheme than the settings the check ran with: `served_as` read
    from its log's kernels where they decide it (else the rules'), `expected` the rules', and a
    `mismatch` of the two."""

    settings: dict[str, str]
    served_as: dict[str, str]
    because: list[str]
    served: bool
    expected: dict[str, str] | None = None
    mismatch: str | None = None
    reason: str | None = None
    agreement: Agreement | None = None
    kernels: list[str] | None = None


class BatchThroughput(RecordPart):
    tokens_per_s: float
    seconds: list[float]
    first_token_seconds: list[float]
    median_seconds: float
    generated_tokens: int
    bound_tokens_per_s: float


class Throughput(RecordPart):
    """Decode tokens/s per batch size (median of runs) and the memory-bandwidth bound beside it."""

    batches: dict[str, BatchThroughput]
    bandwidth_bytes_per_s: float
    tensor_bytes: int
    decode_tokens: int
    bound: str


class BatchRate(RecordPart):
    """A summary's decode rate at one batch size, and the bound."""

    tokens_per_s: float
    bound_tokens_per_s: float


class ServedSummary(_Sparse):
    """What a verdict (its `serving`) and a serving ledger record keep of a serve check: served or
    not (and why), the agreement, greedy matches and decode tokens/s against the bound."""

    served: bool
    status: Status | None = None
    reason: str | None = None
    engine: dict[str, str] | None = None
    dtype: str | None = None
    device: str | None = None
    quantized_activations: bool | None = None
    greedy: Greedy | None = None
    device_class: str | None = None
    engine_settings: dict[str, str] | None = None
    schemes: list[SchemeServed] | None = None
    kernels: list[str] | None = None
    engine_default: EngineDefault | None = None
    log: str | None = None
    agreement: Agreement | None = None
    throughput: dict[str, BatchRate] | None = None
    bandwidth_bytes_per_s: float | None = None


class ServeRecord(Record):
    """A serve check (evalsets.served.check), or a serve that failed (`status` failed: never
    written, the run's record of the unit, with only `served`, `status`, `reason` and `engine`)."""

    KIND = KIND
    WHAT = "serve record"
    READS = (SCHEMA_VERSION,)

    kind: Literal["serve"] = "serve"
    schema_version: Literal[3] = SCHEMA_VERSION
    served: bool
    status: Status
    engine: dict[str, str]  # the serving environment's identity (serving.ServingEnv.identity)
    reason: str | None = None  # why not served, or pending
    # pending because vLLM's CPU worker would not fit in what the check's process could use: what it
    # needs (core.memory.serve_needs); such a record is never reused, the next run checks memory again
    memory_needed_bytes: int | None = None
    checkpoint: str | None = None
    settings: dict[str, JsonValue] | None = None  # the ServeCheckConfig it ran with, as written
    quantized_activations: bool | None = None
    machine: ServeMachine | None = None
    serve_check_version: int | None = None
    device_class: str | None = None
    engine_settings: dict[str, str] | None = None
    schemes: list[SchemeServed] | None = None
    probe_limit_seconds: float | None = None
    load_deadline_seconds: float | None = None  # how long its engine could take to load (evalsets.served.load_deadline)
    load_deadline_basis: str | None = None  # where that number comes from
    gated: GatedSide | None = None
    not_compared: str | None = None  # why nothing was compared (no gated text-set results)
    log: str | None = None
    kernels: list[str] | None = None
    probe: Probe | None = None
    probe_retried: Probe | None = None  # a first attempt the probe stopped, tried once more (the machine's load?)
    probe_not_retried: str | None = None  # why a probe stop was not tried again: too little left of the check's cap
    answer_cap_seconds: float | None = None  # the check's cap on waiting for engines that have not answered (evalsets.served._Budget)
    answer_cap_spent_seconds: float | None = None  # what its serves spent of it
    isolated: bool | None = None
    dtype: str | None = None
    device: str | None = None
    threads: int | None = None
    load_seconds: float | None = None
    startup_seconds: float | None = None  # asked to loaded, as the caller waited
    cold_start_seconds: float | None = None  # importing vLLM plus loading the engine: the base of the candidates' load deadline
    seconds: float | None = None
    agreement: Agreement | None = None
    greedy: Greedy | None = None
    engine_default: EngineDefault | None = None
    throughput: Throughput | None = None

    def mismatches(self) -> list[str]:
        """Where the engine's log shows another scheme than serving.device.RULES expect: the
        serve's own schemes and its engine-default serve's."""
        found = [entry.mismatch for entry in self.schemes or [] if entry.mismatch]
        if self.engine_default is not None and self.engine_default.mismatch:
            found.append(f"under the engine's defaults: {self.engine_default.mismatch}")
        return found

    def to_json(self) -> dict[str, Any]:
        """The fields the check reached (see the module docstring), with its kind and version."""
        return {"kind": self.kind, "schema_version": self.schema_version,
                **self.model_dump(mode="json", by_alias=True, exclude_unset=True)}

    def probe_seconds(self) -> float | None:
        """The forward pass after warm-up (the probe's fastest later pass), or None."""
        passes = self.probe.forward_seconds if self.probe is not None else []
        timed = passes[1:] or passes
        return float(min(timed)) if timed else None

    def summary(self) -> ServedSummary:
        """What a verdict record keeps of it (ServedSummary); the whole record is serve/<name>.json."""
        keep = ("served", "status", "reason", "engine", "dtype", "device", "quantized_activations", "greedy", "device_class",
                "engine_settings", "schemes", "kernels", "engine_default", "log")
        fields: dict[str, Any] = {key: getattr(self, key) for key in keep if key in self.model_fields_set}
        if self.agreement is not None:
            fields["agreement"] = self.agreement.kept()
        if self.throughput is not None:
            fields["throughput"] = {batch: BatchRate(tokens_per_s=entry.tokens_per_s, bound_tokens_per_s=entry.bound_tokens_per_s)
                                    for batch, entry in self.throughput.batches.items()}
            fields["bandwidth_bytes_per_s"] = self.throughput.bandwidth_bytes_per_s
        return ServedSummary(**fields)
