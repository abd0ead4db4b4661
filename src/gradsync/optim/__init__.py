"""Sharded optimizers: ZeRO stage 1 over the data-parallel ranks (see ``sharded.py``).

layout.py    where each rank's slice of every flat bucket lies (pure planning)
buffers.py   the flat parameter buffer of a bucket; which optimizer classes are elementwise
piecewise.py whether an optimizer steps a piece of a tensor to the whole tensor's bits
sharded.py   ShardedOptimizer: the torch.optim.Optimizer users build
groups.py    the param groups and explicit buckets it is built from
agree.py     the check, before a step, that every rank steps alike
clip.py      clipping by the global norm of gradients spread over ranks
state.py     sharded (DCP, reshards) and full (consolidated) state dicts
master.py    MasterWeights: fp32 weights stepped on fp32 main gradients of a bf16 model
"""

from gradsync.optim.clip import clip_grad_norm_
from gradsync.optim.layout import Piece, ShardLayout, plan_shards
from gradsync.optim.master import MasterWeights
from gradsync.optim.sharded import ShardedOptimizer
from gradsync.optim.state import StateShard

__all__ = [
    "MasterWeights",
    "Piece",
    "ShardLayout",
    "ShardedOptimizer",
    "StateShard",
    "clip_grad_norm_",
    "plan_shards",
]
