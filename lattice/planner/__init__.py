"""The planner: a whole training setup (layout, pipeline schedule, ZeRO stage, precision,
activation checkpointing, micro-batches) priced as one step on a machine (lattice.planner.pricing),
a pipelined step's projection beside it (.projection), and the search over every setup of a model
on N ranks that `lattice plan --auto` ranks (.search). Built on the analytic model
(lattice.cost); `lattice plan` prints what it finds (lattice.cli.plan)."""

from lattice.planner.pricing import Choice, Priced, price
from lattice.planner.projection import pipeline_projection
from lattice.planner.search import Ranking, search

__all__ = ["Choice", "Priced", "Ranking", "pipeline_projection", "price", "search"]
