"""Stage 4: versioned golden sets (`load`, `verify`, `add`) and the evaluator (`run`): lm-eval
tasks generated from the sets' manifests, per-item results, KL / top-1 agreement with the baseline."""

from quantgate.evalsets.config import AddConfig, EvalBackend, EvaluateConfig, GenerationSettings, GoldenItem, GoldenManifest, Kind
from quantgate.evalsets.evaluate import EvaluationResults, Evaluator, as_served, load_results, run
from quantgate.evalsets.results import ItemRecord, ItemsFile, ModelIdentity, ResultsManifest, RunSettings, SetRecord, SetResults
from quantgate.evalsets.sets import AddedSet, GoldenSet, add, demo_limits, list_sets, load, verify

__all__ = [
    "AddConfig", "AddedSet", "as_served", "EvalBackend", "EvaluateConfig", "EvaluationResults", "Evaluator", "GenerationSettings",
    "GoldenItem", "GoldenManifest", "GoldenSet", "ItemRecord", "ItemsFile", "Kind", "ModelIdentity", "ResultsManifest", "RunSettings",
    "SetRecord", "SetResults", "add", "demo_limits", "list_sets", "load", "load_results",
    "run", "verify",
]
