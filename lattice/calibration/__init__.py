"""Calibration: micro-benchmarks, run in every rank of a gloo world at once, that fill the cost
model's machine (lattice.cost.Machine) with this machine's rates and curves: matrix products,
attention and elementwise operators (.calibrate), collectives and the waits of ranks sharing
cores (.comm), timed in turn or as differences within each round (.timing). A pipeline
schedule's own time is fitted as what the planner's price of it leaves out."""
