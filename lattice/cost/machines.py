"""Machine presets of the cost model (`lattice plan --machine NAME`), per rank (one GPU, or one
process on this CPU), at published rates or this repository's micro-benchmarks:

- `cpu-2core`: this 2-core machine, gloo, one thread per rank, calibrated by
  `python benchmarks/planner_validation.py --calibrate` (matrix products, attention and elementwise
  operators at the per-rank shapes of a p-way split, α and β from collectives between compute,
  a point-to-point exchange's latency between compute, AdamW; every sample at least 50 ms) at 1
  rank, and at 2, 4 and 8 ranks by the planner validation's calibrations of gpt2-small, with every
  curve the model reads (cpu_2core.json, which names the result files they come from): where ranks
  outnumber the cores they share them, and every collective waits for its ranks to be scheduled
  (`Machine.by_world`).
- `frontera-rtx` (Optimus's testbed: 4 Quadro RTX 5000 per node, PCIe, InfiniBand FDR),
  `longhorn-v100` (the 3D paper's: 4 V100 SXM2 per node, NVLink 2.0, InfiniBand EDR),
  `dgx2h-v100` (Megatron-LM's 2019 runs: 16 V100 SXM3 per node, NVSwitch, 8 x InfiniBand EDR),
  `lassen-v100` (SUPER's: as Longhorn with dual-rail EDR), `a100-node` (DGX A100: 8 GPUs, NVSwitch,
  8 x HDR 200 Gb/s) and `h100-node` (DGX H100: 8 GPUs, NVSwitch, 8 x NDR 400 Gb/s).

GPU rates: the matrix-product rate is the dense half-precision peak times the efficiency an
H200 reached here on large products (851 of 989 TFLOP/s, benchmarks/results/cuda_h200.json), and
`kernel_flops` the size at which a product reaches half of it (7.9 GFLOP fitted to the same
curve), both scaled by each card's peak; attention and elementwise rates are the H200's measured
ones scaled by peak FLOP/s and by memory bandwidth; the framework's time per operation (49.5 µs, a
tiny model of one and two blocks on that machine, `benchmarks/cuda_check.py --parts overheads`) is
its host's, taken for every preset. Links run at what NCCL measures of them: 80% of NVLink's
line rate, an all-reduce inside a DGX H100 at NVLink SHARP's 480 GB/s of bus bandwidth, and 96% of
InfiniBand's, where each GPU gets its node's bandwidth over its GPUs (every rank of a node sends at
once in a data-parallel reduction); α 5 µs over NVLink / NVSwitch, 10 µs over PCIe, 15 µs over
InfiniBand (NCCL's small message latencies).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING
from dataclasses import fields as dataclass_fields

from lattice.cost.machine import BY_WORLD_FIELDS, Machine
from lattice.parallel.context import LatticeConfigError

_H200_EFFICIENCY = 851 / 989  # large bf16 products against the dense peak
_H200_KERNEL_FLOPS, _H200_PEAK, _H200_HBM = 7.9e9, 989e12, 4.8e12
_H200_ATTENTION, _H200_ELEMENTWISE = 1.77e12, 5.0e11  # score elements/s (fwd+bwd as 3 forwards), elements/s
# the framework's time per described operation was measured on the H200's host when attention
# counted as two of a GPT-2 block's 9 operations (benchmarks/results/cuda_h200.json); per
# operation as counted now (8 a block) it is 9/8 of the figure measured
_OPS_RECOUNT = 9 / 8
_H200_OP_OVERHEAD = 44e-6 * _OPS_RECOUNT  # s per described operation (forward; backward twice), the H200's host


# NCCL moves about 80% of NVLink's line rate (its protocols' overhead: NCCL's maintainer in
# nccl-tests issue #212, 8 H100 at 370 GB/s of 450 in every collective but all-reduce); 8 A100 SXM4
# all-reduce at 200-208 GB/s of bus bandwidth (nccl-tests #149, #178), where 0.8 x 300 is 240
_NCCL_NVLINK = 0.8
# and about 96% of InfiniBand's: 8 A100 with 4 HDR NICs a node all-reduce over 3 nodes at up to
# 96 GB/s of the NICs' 100 (nccl-tests #119)
_NCCL_IB = 0.96


def gpu_machine(name: str, *, peak_half: float, peak_fp32: float, hbm: float, memory_gib: float, ranks_per_node: int,
         intra_gbs: float, alpha_intra: float, node_nic_gbs: float, nvlink: bool = True,
         allreduce_gbs: float = 0.0) -> Machine:
    """A GPU node's rates: `intra_gbs` the line rate of a GPU's link inside the node (NVLink, of
    which NCCL moves _NCCL_NVLINK; else PCIe's rate as measured), `node_nic_gbs` the line rate of
    the node's InfiniBand NICs together, `allreduce_gbs` an all-reduce's bus bandwidth inside the
    node where the switch reduces (NVLink SHARP)."""
    intra = intra_gbs * (_NCCL_NVLINK if nvlink else 1.0) * 1e9
    return Machine(
        name, flop_rate=peak_half * _H200_EFFICIENCY, other_precision_flop_rate=peak_fp32 * _H200_EFFICIENCY,
        precision="bf16", kernel_flops=_H200_KERNEL_FLOPS * peak_half / _H200_PEAK,
        attn_rate=_H200_ATTENTION * peak_half / _H200_PEAK, elem_rate=_H200_ELEMENTWISE * hbm / _H200_HBM,
        alpha_intra=alpha_intra, beta_intra=1 / intra, alpha_inter=15e-6,
        beta_inter=1 / (_NCCL_IB * node_nic_gbs * 1e9 / ranks_per_node), ranks_per_node=ranks_per_node,
        update_per_tensor=10e-6,
        mem_bandwidth=hbm, pipelined_broadcast=True, memory_gib=memory_gib, op_overhead=_H200_OP_OVERHEAD,
        collectives=(("all_reduce", alpha_intra, 1 / (allreduce_gbs * 1e9)),) if allreduce_gbs else ())


def frozen(value):
    """JSON's lists (a file's by_world rows, their collectives) as the tuples a Machine holds (compared, hashed)."""
    return tuple(frozen(v) for v in value) if isinstance(value, list) else value


def _cpu_rows() -> tuple:
    """cpu-2core's rows at 2, 4 and 8 ranks (cpu_2core.json: every column of BY_WORLD_FIELDS of the
    planner validation's calibrations of gpt2-small at each world size; the file names its sources).
    docs/validation.md gives how closely they price the measured steps."""
    with open(os.path.join(os.path.dirname(__file__), "cpu_2core.json")) as f:
        rows = json.load(f)["rows"]
    return tuple(frozen([row[name] for name in BY_WORLD_FIELDS]) for row in rows)


MACHINES: dict[str, Machine] = {
    # the rates of one rank: `benchmarks/planner_validation.py --calibrate` (each sample of a
    # micro-benchmark at least 50 ms long, so that ranks beyond the cores share them while it is timed);
    # the update's per tensor and bandwidth scaled to the fused AdamW (x0.267 and x3.82: the fused form
    # against the foreach one that calibration timed, timed in turn; cpu_2core.json)
    "cpu-2core": Machine(
        "this machine (2 cores, gloo, 1 thread per rank)", flop_rate=8.23e+10, alpha_intra=1e-5, beta_intra=1e-10,
        alpha_inter=1e-5, beta_inter=1e-10, ranks_per_node=8, elem_rate=1.78e+09, attn_rate=6.04e+08,
        update_per_tensor=3.92e-06, mem_bandwidth=5.31e+10, op_overhead=1.6e-05, norm_per_tensor=3.86e-06,
        memory_gib=0.0, cores=2, kernel_rows=9.0,
        # and of 2, 4 and 8 ranks: the validation's calibrations, every column (_cpu_rows)
        by_world=((1, 8.23e+10, 1.78e+09, 6.04e+08, 1e-05, 1e-10, 3.92e-06, 5.31e+10, 1.6e-05, 0, 0, 3.86e-06,
                   (), 9.0), *_cpu_rows())),
    "frontera-rtx": gpu_machine("Frontera RTX: 4 Quadro RTX 5000 per node, PCIe 3.0, InfiniBand FDR", peak_half=89.2e12,
                         peak_fp32=11.2e12, hbm=448e9, memory_gib=16, ranks_per_node=4, intra_gbs=12,
                         alpha_intra=10e-6, node_nic_gbs=7, nvlink=False),
    "longhorn-v100": gpu_machine("Longhorn: 4 V100 SXM2 per node, NVLink 2.0, InfiniBand EDR", peak_half=125e12,
                          peak_fp32=15.7e12, hbm=900e9, memory_gib=16, ranks_per_node=4, intra_gbs=75,
                          alpha_intra=5e-6, node_nic_gbs=12.5),
    "lassen-v100": gpu_machine("Lassen: 4 V100 SXM2 per node, NVLink 2.0, dual-rail InfiniBand EDR", peak_half=125e12,
                        peak_fp32=15.7e12, hbm=900e9, memory_gib=16, ranks_per_node=4, intra_gbs=75,
                        alpha_intra=5e-6, node_nic_gbs=25),
    "a100-node": gpu_machine("DGX A100: 8 A100 80GB per node, NVSwitch, 8 x InfiniBand HDR 200 Gb/s", peak_half=312e12,
                      peak_fp32=156e12, hbm=2.0e12, memory_gib=80, ranks_per_node=8, intra_gbs=300,
                      alpha_intra=5e-6, node_nic_gbs=200),
    "dgx2h-v100": gpu_machine("DGX-2H: 16 V100 SXM3 32GB (450 W) per node, NVSwitch, 8 x InfiniBand EDR 100 Gb/s",
                       peak_half=130e12, peak_fp32=16.4e12, hbm=900e9, memory_gib=32, ranks_per_node=16,
                       intra_gbs=150, alpha_intra=5e-6, node_nic_gbs=100),
    "h100-node": gpu_machine("DGX H100: 8 H100 80GB per node, NVSwitch, 8 x InfiniBand NDR 400 Gb/s", peak_half=989e12,
                      peak_fp32=494e12, hbm=3.35e12, memory_gib=80, ranks_per_node=8, intra_gbs=450,
                      alpha_intra=5e-6, node_nic_gbs=400, allreduce_gbs=480),
}


def machine_named(spec: str) -> Machine:
    """A preset by name, or a Machine from a JSON file or inline JSON (e.g. a calibration that
    `lattice bench` wrote; `by_world` as a list of [ranks, F, elementwise, attention, α, β])."""
    if spec in MACHINES:
        return MACHINES[spec]
    try:
        text = open(spec).read() if os.path.isfile(spec) else spec
        values = json.loads(text)
    except (OSError, ValueError) as e:
        raise LatticeConfigError(f"--machine {spec[:60]!r} is no preset ({', '.join(MACHINES)}), JSON file or inline "
                                 f"JSON ({type(e).__name__}); pass a preset or e.g. '{{\"flop_rate\": 1e12, ...}}'") from None
    known = {f.name for f in dataclass_fields(Machine)}
    if not isinstance(values, dict) or set(values) - known:
        extra = sorted(set(values) - known) if isinstance(values, dict) else type(values).__name__
        raise LatticeConfigError(f"--machine has unknown fields {extra}; Machine takes {', '.join(sorted(known))}")
    required = {f.name for f in dataclass_fields(Machine) if f.default is MISSING} - {"name"}
    if required - set(values):
        raise LatticeConfigError(f"--machine lacks {sorted(required - set(values))}; give every one of "
                                 f"{', '.join(sorted(required))}")
    return Machine(**{"name": "given", **{k: frozen(v) for k, v in values.items()}})


#: the preset of a GPU by a word of its name (torch.cuda.get_device_name)
_GPU_PRESETS = (("H100", "h100-node"), ("H200", "h100-node"), ("A100", "a100-node"), ("V100", "longhorn-v100"),
                ("RTX 5000", "frontera-rtx"))


def machine_of_device(device_name: str | None) -> tuple[Machine, str]:
    """(the rates, their name) that `lattice train` prices its choice of a mode's options with:
    the preset of the GPU named (an H200 at the H100's rates, the nearest preset; any other GPU
    too, said in the name), or on CPU the `cpu-2core` preset."""
    if device_name is None:
        return MACHINES["cpu-2core"], "cpu-2core"
    for word, preset in _GPU_PRESETS:
        if word in device_name:
            return MACHINES[preset], preset if word.lower() in preset else f"{preset} (for the {word})"
    return MACHINES["h100-node"], f"h100-node (no preset for {device_name})"


#: where each preset's rates come from, for the line `lattice plan --auto` prints
PRESET_SOURCES = {
    "cpu-2core": "measured on another host (2 x86_64 cores, gloo, 1 thread per rank; cpu_2core.json names the "
                 "results its rows come from), which this host's may differ from: --machine here for its own",
    **{name: ("published peaks, links at NCCL's measured share of their line rates, the H200's measured product "
               "and attention curves scaled by peak")
       for name in ("frontera-rtx", "longhorn-v100", "lassen-v100", "a100-node", "dgx2h-v100", "h100-node")},
}


def rates_of(spec: str) -> str:
    """Whose rates `spec` (a preset, a JSON file or inline JSON) are, in words."""
    if spec in MACHINES:
        return f"the {spec} preset, {PRESET_SOURCES[spec]}"
    return f"as given ({spec[:60]})"
