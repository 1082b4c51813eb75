"""The parallel primitives every other room builds on: the topology and the per-rank context
(`context`), collectives as autograd Functions with their meter (`comm`), shard specs and the
full-tensor gathers they give (`sharding`), pipeline stages and schedules (`pipeline`) and the
distributed optimizer over data parallelism (`zero`). Nothing here knows a mode or a family."""
