"""`quantgate evalsets ...` and `quantgate evaluate`: stage 4, golden sets and the evaluator."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from quantgate import evalsets
from quantgate.cli.options import config, print_json
from quantgate.core.errors import InputError, IntegrityError
from quantgate.core.formats import PRECISION_CLASSES
from quantgate.gates import samplesize

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)

evalsets_app = typer.Typer(help="Versioned golden sets: list, show, audit, add your own, plan their items.", no_args_is_help=True)
commands.add_typer(evalsets_app, name="evalsets")


@evalsets_app.command("list")
def evalsets_list(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List every version of every golden set, built-in and your own ($QUANTGATE_HOME/evalsets).

    Example: quantgate evalsets list
    """
    rows = evalsets.list_sets()
    if as_json:
        print_json(rows)
        return
    for row in rows:
        typer.echo(f"{row['spec']}\t{row['kind']}\t{row['items']} items\t{row['origin']}\t{row['licence']}\t{row['title']}")


@evalsets_app.command("show")
def evalsets_show(
    spec: str = typer.Argument(..., help="NAME or NAME@vN (default: the latest version)"),
    items: int = typer.Option(0, "--items", help="also print the first N items"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as JSON"),
) -> None:
    """Show a golden set's manifest (source, licence, prompt, scoring, hashes), verified first.

    Example: quantgate evalsets show arc-easy@v1 --items 2
    """
    golden = evalsets.load(spec)
    if as_json:
        print_json(golden.manifest)
    else:
        manifest = golden.manifest
        source = manifest["source"]
        typer.echo(f"{golden.spec} ({golden.origin}): {manifest['title']}")
        typer.echo(f"  kind {manifest['kind']}, {manifest['items']} items, sha256 {golden.sha256}")
        typer.echo(f"  scoring: {', '.join(manifest['scoring']['metrics'])} (primary {manifest['scoring']['primary']})")
        typer.echo(f"  order: {manifest['order']['rule']}")
        typer.echo(f"  source: {source.get('package', source.get('file'))} {source.get('version', '')} {source.get('file', '')}".rstrip())
        typer.echo(f"  licence: {manifest['licence']}")
        typer.echo(f"  attribution: {manifest['attribution']}")
        typer.echo(f"  rebuild: {manifest['rebuild']}")
        typer.echo(f"  path: {golden.path}")
    for item in golden.items(items) if items else []:
        typer.echo(json.dumps(item, ensure_ascii=False))


@evalsets_app.command("audit")
def evalsets_audit() -> None:
    """Check every file of every golden set against its manifest's sha256, and every item; exit 2 if one fails.

    Example: quantgate evalsets audit
    """
    results = evalsets.verify()
    for result in results:
        typer.echo(f"{'ok' if result.ok else 'FAILED'}\t{result.spec}\t{result.message}")
    failed = [result.spec for result in results if not result.ok]
    if failed:
        raise IntegrityError(f"{len(failed)} of {len(results)} golden sets failed the audit: {', '.join(failed)}")


@evalsets_app.command("add")
def evalsets_add(
    name: str = typer.Option(..., "--name", help="your set's name (lower case, digits, '.', '_', '-')"),
    kind: str = typer.Option(..., "--kind", help="multiple-choice, text, last-word or generation"),
    source: Path = typer.Option(..., "--from", help="JSONL file, one item a line (fields per kind: docs/evaluate.md)"),
    title: str | None = typer.Option(None, "--title"),
    description: str = typer.Option("", "--description"),
    licence: str = typer.Option("unspecified (user supplied)", "--licence"),
    attribution: str = typer.Option("user supplied", "--attribution"),
    stop: list[str] | None = typer.Option(None, "--stop", help="generation: a stop sequence; repeatable (default: newline)"),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="generation: greedy tokens at most (default 64)"),
) -> None:
    """Add your own golden set: the JSONL becomes v1, or the next version if the items changed.

    multiple-choice lines hold query, choices, gold; text: text; last-word: context, target
    (with its leading space); generation: prompt, reference. Optional on every kind: id, meta.

    Example: quantgate evalsets add --name support-faq --kind multiple-choice --from faq.jsonl
    """
    generation = None
    if stop is not None or max_new_tokens is not None:
        generation = config(
            evalsets.GenerationSettings,
            **({"until": tuple(stop)} if stop is not None else {}),
            **({"max_new_tokens": max_new_tokens} if max_new_tokens is not None else {}),
        )
    cfg = config(
        evalsets.AddConfig, name=name, kind=kind, title=title, description=description, licence=licence,
        attribution=attribution, generation=generation,
    )
    added = evalsets.add(cfg, source)
    state = "added" if added.created else "unchanged, already"
    typer.echo(f"{state} {added.golden.spec}: {added.golden.size} {cfg.kind.value} items, sha256 {added.golden.sha256}")
    typer.echo(f"  at {added.golden.path}")


@evalsets_app.command("plan")
def evalsets_plan(
    policy: str = typer.Option("default", "--policy", help="a policy YAML file, or NAME or NAME@vN of a built-in one"),
    precision: str | None = typer.Option(None, "--precision", help=f"{' or '.join(PRECISION_CLASSES)} bounds (default: every class the policy gives)"),
    effect: list[str] | None = typer.Option(None, "--effect", help="the true distance from the bound to plan for, in each "
                                            "gate's unit: X (every gate) or METRIC=X; repeatable (default: half of each "
                                            "bound's distance from no change)"),
    discordance: float | None = typer.Option(None, "--discordance", help="accuracy gates: the share of items the two models "
                                             "answer differently (default: " + ", ".join(f"{value:g} for {precision}" for precision, value in
                                                                                samplesize.DEFAULT_DISCORDANCE.items()) + ")"),
    power: float = typer.Option(samplesize.DEFAULT_POWER, "--power", help="the chance of a decisive verdict at that effect"),
    baseline_results: Path | None = typer.Option(None, "--baseline-results", help="a baseline's results: with "
                                                 "--candidate-results, each gate's per-item spread is measured on them"),
    candidate_results: Path | None = typer.Option(None, "--candidate-results", help="a candidate's results, evaluated "
                                                  "against --baseline-results"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
) -> None:
    """How many items each gate of a policy needs for a decisive verdict, and at which look.

    For each gate: the items at which its interval, at the policy's confidence split over the
    set's looks, lies wholly on one side of the bound with the given power when the truth is the
    effect away from it; the set's looks and size, and the look that count falls in. Accuracy
    gates take their per-item spread from a discordance; other gates need results.

    Example: quantgate evalsets plan --policy small-model --discordance 0.2
    """
    result = samplesize.plan(policy, precision=precision, effects=effect or (), discordance=discordance,
                             baseline_results=baseline_results, candidate_results=candidate_results, power=power)
    if as_json:
        print_json(result.as_dict())
        return
    for line in result.lines():
        typer.echo(line)


def _parse_limits(values: list[str] | None, demo_limits: bool) -> tuple[int | None, dict[str, int]]:
    """--limit N (every set) and --limit NAME=N (one set); --demo-limits starts from the shipped table."""
    common: int | None = None
    per_set: dict[str, int] = dict(evalsets.demo_limits()) if demo_limits else {}
    for value in values or []:
        name, _, number = value.rpartition("=")
        try:
            limit = int(number)
        except ValueError as error:
            raise InputError(f"invalid --limit {value!r}: expected N or NAME=N") from error
        if name:
            per_set[name] = limit
        else:
            common = limit
    return common, per_set


@commands.command("evaluate")
def evaluate_command(
    model: str = typer.Option(..., "--model", help="model or checkpoint directory, or a demo model name"),
    evalset: list[str] = typer.Option(..., "--evalset", help="NAME or NAME@vN; repeatable"),
    out: Path = typer.Option(..., "--out", help="results directory (appears only when complete)"),
    limit: list[str] | None = typer.Option(None, "--limit", help="first N items of each set (N), or of one set (NAME=N); repeatable"),
    demo_limits: bool = typer.Option(False, "--demo-limits", help="use the per-set demo limits (evalsets/demo_limits.yaml)"),
    baseline_results: Path | None = typer.Option(None, "--baseline-results", help="the baseline's results directory: KL divergence and top-1 agreement on text sets"),
    no_cache: bool = typer.Option(False, "--no-cache", help="recompute even if the cache holds these results"),
    batch_size: int = typer.Option(4, "--batch-size"),
    backend: str = typer.Option("hf", "--backend", help="hf (transformers, in --dtype) or vllm (the serving environment: quantgate serving setup)"),
    engine_setting: list[str] | None = typer.Option(None, "--engine-setting", help="--backend vllm: KEY=VALUE, an environment variable vLLM runs under (e.g. VLLM_CPU_INT4_W4A8=1); repeatable"),
    max_tokens: int = typer.Option(512, "--max-tokens", help="text sets: tokens scored per item"),
    top_k: int = typer.Option(64, "--top-k", help="text sets: baseline log-probabilities cached per position"),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (FP32 on a CPU, the storage dtype on a GPU), float32 or bfloat16"),
    placement: str = typer.Option("auto", "--placement", help="where the model is kept: auto (in memory where it fits, else "
                                  "streamed), memory, or streamed (from disk, one module's weights at a time; the same scores)"),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="accept a model whose weights are pickle files"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing results directory at --out"),
    as_json: bool = typer.Option(False, "--json", help="print the results manifest as JSON"),
) -> None:
    """Evaluate a model on golden sets: metrics, per-item results, agreement with a baseline.

    Multiple-choice, last-word and generation sets run through lm-eval (tasks generated from
    the sets' manifests, offline); text sets through transformers. Results are cached by
    weights, set, settings and library versions: asking again returns them at once.

    Example: quantgate evaluate --model ckpt/gptq-int4 --evalset arc-easy --evalset wiki-text --limit 100 --baseline-results results/baseline --out results/gptq-int4
    """
    common, per_set = _parse_limits(limit, demo_limits)
    settings = {}
    for item in engine_setting or []:
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise InputError(f"--engine-setting takes KEY=VALUE, got {item!r}")
        settings[key.strip()] = value
    cfg = config(
        evalsets.EvaluateConfig,
        evalsets=tuple(evalset), limit=common, limits=per_set, backend=backend, engine_settings=settings, batch_size=batch_size,
        max_tokens=max_tokens, top_k=top_k, device=device, dtype=dtype, use_cache=not no_cache, allow_pickle=allow_pickle,
        placement=placement,
    )
    results = evalsets.run(cfg, model, out, baseline_results=baseline_results, overwrite=overwrite)
    if as_json:
        print_json(results.manifest.to_json())
        return
    for spec, entry in results.manifest.sets.items():
        metrics = entry.metrics
        shown = ", ".join(f"{name} {metrics[name]:.4g}" for name in sorted(metrics) if "stderr" not in name)
        source = "cached" if entry.from_cache else f"{entry.seconds:.1f} s"
        typer.echo(f"{spec}\t{entry.items} items\t{source}\t{shown}")
    typer.echo(f"results written to {results.path}")
