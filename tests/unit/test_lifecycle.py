"""The wrapper's lifecycle ([Note: the wrapper's lifecycle]): what each state allows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync
from gradsync.ddp.forward import Lifecycle


def test_a_wrapper_is_configurable_until_its_first_forward_with_grad(one_rank: None) -> None:
    model = gradsync.DistributedDataParallel(nn.Linear(3, 1))
    assert model.lifecycle is Lifecycle.CONFIGURABLE
    with torch.no_grad():
        model(torch.ones(2, 3))  # nothing to synchronise: still configurable
    assert model.lifecycle is Lifecycle.CONFIGURABLE
    model.shard_optimizer(torch.optim.SGD, lr=0.1)  # allowed now
    model(torch.ones(2, 3)).sum().backward()
    assert model.lifecycle is Lifecycle.TRAINING
    with pytest.raises(gradsync.ProtocolError, match="before the first forward"):
        model.register_comm_hook(None, lambda state, bucket: None)


def test_a_rewrapped_model_retires_the_old_wrapper(one_rank: None) -> None:
    net = nn.Linear(3, 1)
    old = gradsync.DistributedDataParallel(net)
    old(torch.ones(2, 3)).sum().backward()
    new = gradsync.DistributedDataParallel(net)
    assert old.lifecycle is Lifecycle.RETIRED and new.lifecycle is Lifecycle.CONFIGURABLE
    with pytest.raises(gradsync.ProtocolError, match="wrapped again at .*test_lifecycle.py:[0-9]+"):
        old(torch.ones(2, 3))
    new(torch.ones(2, 3)).sum().backward()  # the new one trains
    assert new.lifecycle is Lifecycle.TRAINING


def test_a_failed_wrapper_issues_no_more_collectives(one_rank: None) -> None:
    model = gradsync.DistributedDataParallel(nn.Linear(3, 1))
    model.reducer.deadline.failure = "rank 0 gave up waiting for the all-reduce of bucket 0."
    assert model.lifecycle is Lifecycle.FAILED
    with pytest.raises(gradsync.CollectiveTimeoutError, match="gave up waiting"):
        model(torch.ones(2, 3))
