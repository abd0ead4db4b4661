"""Where a wrapper is in its life.

[Note: the wrapper's lifecycle]
A wrapper is CONFIGURABLE from construction until its first forward with grad enabled:
``shard_optimizer()`` and ``register_comm_hook()`` change how every step runs and must come
before it. Then it is TRAINING. It is FAILED once one of its collectives failed or timed out
(its process group may still hold that collective, so it issues no more) and RETIRED once a
newer wrapper of the same parameters took their hooks over. :attr:`DDPState.lifecycle` is the
one place that says which; FAILED and RETIRED are facts of the deadline and the reducer, read
from them rather than copied. An unpickled wrapper is LOADED (its module, not built) until its
first use that involves the ranks builds it ([Note: a pickled wrapper]).
"""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    """Where a wrapper is in its life ([Note: the wrapper's lifecycle])."""

    LOADED = "loaded"  # unpickled, built at its first use (compat/pickling.py)
    CONFIGURABLE = "configurable"  # built, no forward yet: shard_optimizer, register_comm_hook
    TRAINING = "training"  # a forward with grad enabled ran through it
    FAILED = "failed"  # a collective failed or timed out: it issues no more
    RETIRED = "retired"  # a newer wrapper of the same parameters took them over
