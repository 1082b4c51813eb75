"""The analytic cost model and the machines it prices on: lattice.cost.model (one step of any
family in any layout; .builder its operations), .machine (collective algorithms and the α-β-F
machine), .machines (the presets), .pipeline and .stages (point-to-point traffic, in-flight
micro-batches) and .tables (the papers' tables). Calibration (lattice.calibration) measures a
machine's rates; the planner (lattice.planner) prices and ranks whole training setups on them."""

from lattice.cost.machine import PAPER_CLUSTER, Machine, Term, message_steps, wire_factor
from lattice.cost.model import DDP_BUCKET_BYTES, Cost, CostBuilder, estimate, model_config
from lattice.cost.pipeline import in_flight, p2p_elements, p2p_piece, stage_sends
from lattice.cost.tables import count_messages, layer_table, optimus_table1, super_messages

__all__ = ["DDP_BUCKET_BYTES", "PAPER_CLUSTER", "Cost", "CostBuilder", "Machine", "Term", "count_messages", "estimate",
           "in_flight", "layer_table", "message_steps", "model_config", "optimus_table1", "p2p_elements", "p2p_piece",
           "stage_sends", "super_messages", "wire_factor"]
