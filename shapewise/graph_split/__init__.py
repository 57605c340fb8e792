"""Splitting-op registry, the split plan, and the Split pass."""

from shapewise.graph_split.draw import draw_split, split_dot, split_graph
from shapewise.graph_split.registry import OpMatcher, register_alias, registered_aliases, resolve_ops
from shapewise.graph_split.split import Split, SplitPlan, apply_plan, plan_split

__all__ = ["OpMatcher", "Split", "SplitPlan", "apply_plan", "draw_split", "plan_split", "register_alias",
           "registered_aliases", "resolve_ops", "split_dot", "split_graph"]
