"""`quantgate run PLAN.yaml`: the run plan, and the runner that orders the stages."""

from quantgate.pipeline.plan import DEMO_PLAN, LoadedPlan, load_plan
from quantgate.pipeline.runner import RunResult, run

__all__ = ["DEMO_PLAN", "LoadedPlan", "RunResult", "load_plan", "run"]
