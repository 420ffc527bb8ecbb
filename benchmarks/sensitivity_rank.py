"""How well the diagonal-Fisher sensitivity proxy ranks decoder blocks on the demo model, and what
it costs: both Fisher variants (sampled labels, real next tokens), against the KL measured by
round-to-nearest quantizing each block alone, for gptq-int4 and smoothquant-w8a8.

    .venv/bin/python benchmarks/sensitivity_rank.py [--rows 16] [--formats gptq-int4,smoothquant-w8a8] [--row-sweep 4,8]

Pulls the demo model into $QUANTGATE_HOME (a no-op once there) and builds the demo calibration
set (16 x 256 tokens, seed 0) in a temporary directory. The measured KL does not depend on the
Fisher variant, so the validation runs once and both proxies are ranked against it; `--row-sweep`
ranks sampled-Fisher proxies estimated on fewer rows against the same measurement. Times are wall
and CPU seconds (CPU counts every thread: on an idle machine wall is about CPU / threads; on a
shared one wall grows with the other load). Figures go to docs/sensitivity.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quantgate.quantize.sensitivity import SensitivityReport, Validation

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(label: str, work: Any) -> tuple[Any, dict[str, float]]:
    started, cpu = time.perf_counter(), time.process_time()
    result = work()
    seconds = {"wall": time.perf_counter() - started, "cpu": time.process_time() - cpu}
    print(f"{label}: {seconds['wall']:.1f} s wall, {seconds['cpu']:.1f} s CPU (load average {os.getloadavg()[0]:.1f})")
    return result, seconds


def ranking(report: SensitivityReport, validation: Validation, fmt: str) -> dict[str, float | None]:
    """Spearman's rho of the report's block totals against the measured block KLs, and their ratio."""
    from quantgate.quantize import sensitivity

    blocks = validation["formats"][fmt]["blocks"]
    proxy = sensitivity.block_totals(report, fmt)
    values, measured = [proxy[block["block"]] for block in blocks], [block["measured_kl"] for block in blocks]
    rho, p_value = sensitivity.rank_correlation(values, measured)
    return {"spearman": rho, "p_value": p_value, "proxy_over_measured": sum(values) / sum(measured)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="gptq-int4,smoothquant-w8a8")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-sweep", default="", help="comma-separated row counts for the sampled Fisher, e.g. 4,8")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--measured", type=Path, help="reuse the measured block KLs of an earlier run's --json")
    arguments = parser.parse_args()

    import torch

    from quantgate import calibration
    from quantgate.core.models import baseline_dtype, compute_dtype, pull
    from quantgate.quantize import sensitivity

    model = pull("smollm2-135m").path
    with tempfile.TemporaryDirectory() as work:
        calibration_set = calibration.run(calibration.CalibrationConfig(
            model=str(model), source="demo", samples=arguments.rows, seq_len=256, seed=0), Path(work) / "calib")
    input_ids, attention_mask = calibration_set.input_ids, calibration_set.attention_mask
    loaded = sensitivity.load_model(model, compute_dtype(baseline_dtype(model)))
    formats = tuple(arguments.formats.split(","))
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")

    reports, seconds = {}, {}
    for variant in sensitivity.FisherVariant:
        cfg = sensitivity.SensitivityConfig(formats=formats, fisher=variant, seed=arguments.seed)
        reports[variant.value], seconds[variant.value] = timed(
            f"proxy, {variant.value} Fisher, {arguments.rows} rows",
            lambda cfg=cfg: sensitivity.score(loaded, input_ids, attention_mask, cfg))
    if arguments.measured:
        # The measurement is deterministic (round-to-nearest, fixed rows): an earlier run's, on the
        # same calibration set, is the same numbers without its half hour.
        earlier = json.loads(arguments.measured.read_text())
        if earlier.get("calibration_fingerprint", calibration_set.fingerprint) != calibration_set.fingerprint:
            raise SystemExit(f"{arguments.measured} was measured on another calibration set")
        validation = earlier["validation"]
        seconds["validation"] = earlier.get("seconds", {}).get("validation", {"wall": validation["seconds"]})
        print(f"validation: reused from {arguments.measured} (measured in {validation['seconds']:.0f} s)")
    else:
        validation, seconds["validation"] = timed(
            "validation (RTN each block alone, measured KL)",
            lambda: sensitivity.validate(loaded, input_ids, attention_mask, reports["sampled"]))
    for rows in [int(count) for count in arguments.row_sweep.split(",") if count]:
        cfg = sensitivity.SensitivityConfig(formats=formats, seed=arguments.seed)
        reports[f"sampled, {rows} rows"], seconds[f"sampled, {rows} rows"] = timed(
            f"proxy, sampled Fisher, {rows} rows",
            lambda cfg=cfg, rows=rows: sensitivity.score(loaded, input_ids[:rows], attention_mask[:rows], cfg))

    figures: dict[str, dict[str, dict[str, float | None]]] = {}
    for fmt in formats:
        for name, report in reports.items():
            figures.setdefault(fmt, {})[name] = found = ranking(report, validation, fmt)
            print(f"{fmt:18s} {name:18s}: Spearman rho {found['spearman']:+.3f} (p {found['p_value']:.2g}) over "
                  f"{len(validation['formats'][fmt]['blocks'])} blocks; block proxies / measured KLs {found['proxy_over_measured']:.2f}")
        top = sorted(validation["formats"][fmt]["blocks"], key=lambda block: block["measured_kl"], reverse=True)[:3]
        print(f"{fmt:18s} most sensitive blocks measured: "
              + ", ".join(f"{block['block']} ({block['measured_kl']:.3g} nats/token)" for block in top))
    if arguments.json:
        arguments.json.write_text(json.dumps({"figures": figures, "validation": validation, "seconds": seconds,
                                              "calibration_fingerprint": calibration_set.fingerprint}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
