"""lattice: multi-dimensional tensor parallelism (1D, 2D, 3D, sub-graph) for transformer model families on PyTorch."""

from lattice.models import available_archs, build_model, from_hf, get_arch
from lattice.models.gpt2 import GPT, GPTConfig
from lattice.modes import available_modes
from lattice.modes.layout import Layout, context, init
from lattice.parallel.comm import CommMeter
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext, Topology

__all__ = ["init", "context", "Layout", "ParallelContext", "Topology", "MeshAxis", "LatticeConfigError", "GPT", "GPTConfig",
           "build_model", "from_hf", "get_arch", "available_archs", "CommMeter", "available_modes"]
__version__ = "0.1.0"
