"""`kvserve plan`: GPU sizing and self-host cost, from model shapes alone."""

from kvserve.planner.plan import Plan, PlanRequest, make_plan

__all__ = ["Plan", "PlanRequest", "make_plan"]
