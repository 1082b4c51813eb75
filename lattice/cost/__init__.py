"""The analytic cost model: lattice.cost.model (one step of any family in any layout; .builder
its operations), .machine (collective algorithms and the α-β-F machine), .calibrate (that machine
fitted here), .pipeline (point-to-point traffic, in-flight micro-batches),
.tables (the papers' tables), .pricing (a training setup's step and memory), .search (the planner)
and .plan (`lattice plan`, tp x pp projections)."""

from lattice.cost.machine import PAPER_CLUSTER, Machine, Term, message_steps, wire_factor
from lattice.cost.model import DDP_BUCKET_BYTES, Cost, CostBuilder, estimate
from lattice.cost.pipeline import in_flight, p2p_elements, p2p_piece, stage_sends
from lattice.cost.plan import pipeline_projection
from lattice.cost.tables import count_messages, layer_table, optimus_table1, super_messages

__all__ = ["DDP_BUCKET_BYTES", "PAPER_CLUSTER", "Cost", "CostBuilder", "Machine", "Term", "count_messages", "estimate",
           "in_flight", "layer_table", "message_steps", "optimus_table1", "p2p_elements", "p2p_piece",
           "pipeline_projection", "stage_sends", "super_messages", "wire_factor"]
