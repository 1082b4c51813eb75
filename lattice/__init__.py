"""lattice: multi-dimensional tensor parallelism (1D, 2D, 3D, sub-graph) for GPT models on PyTorch."""

from lattice.comm import CommMeter
from lattice.context import LatticeConfigError, MeshAxis, ParallelContext, Topology
from lattice.layout import init, plan
from lattice.model import GPT, GPTConfig
from lattice.modes import available_modes

__all__ = ["init", "plan", "ParallelContext", "Topology", "MeshAxis", "LatticeConfigError",
           "GPT", "GPTConfig", "CommMeter", "available_modes"]
__version__ = "0.1.0"
