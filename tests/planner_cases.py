"""What the planner's tests share: an H100 node machine of 4 ranks per node and the GPT-2 model
they price."""

import dataclasses

from lattice.cost.machines import MACHINES
from lattice.cost import model_config

MACHINE = dataclasses.replace(MACHINES["h100-node"], ranks_per_node=4)


def small(n_layers=4, **sizes):
    return model_config("gpt2", "small", vocab_size=512, n_layers=n_layers, **sizes)
