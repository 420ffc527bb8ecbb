"""Stage 4: versioned golden sets (`load`, `verify`, `add`) and the evaluator (`run`): lm-eval
tasks generated from the sets' manifests, per-item results, KL / top-1 agreement with the baseline."""

from quantgate.evalsets.config import AddConfig, EvalBackend, EvaluateConfig, GenerationSettings, Kind
from quantgate.evalsets.evaluate import EvaluationResults, Evaluator, as_served, load_results, run
from quantgate.evalsets.results import ModelIdentity, ResultsManifest, SetResults
from quantgate.evalsets.sets import AddedSet, GoldenSet, add, demo_limits, list_sets, load, verify

__all__ = [
    "AddConfig", "AddedSet", "as_served", "EvalBackend", "EvaluateConfig", "EvaluationResults", "Evaluator", "GenerationSettings",
    "GoldenSet", "Kind", "ModelIdentity", "ResultsManifest", "SetResults", "add", "demo_limits", "list_sets", "load", "load_results",
    "run", "verify",
]
