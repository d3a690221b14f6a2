"""Capacity planning: ``kvserve plan``."""

from kvserve.plan.planner import PlanReport, WhatIf, plan
from kvserve.plan.presets import PRESETS, preset
from kvserve.plan.spec import ModelSpec, SpecError

__all__ = ["PRESETS", "ModelSpec", "PlanReport", "SpecError", "WhatIf", "plan", "preset"]
