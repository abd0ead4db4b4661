"""What a Recovery installs outside itself lives as long as it does: the process-wide watch that
makes every deadline look for a regroup, and the hook on the user's optimizer that keeps the
undo copy. Once the last Recovery is collected, deadlines wait as they did before it."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.data import GlobalBatchSampler
from gradsync.failfast import waiting
from gradsync.failfast.waiting import regroup_begun, watch_for_regroups, watching
from gradsync.recovery import Recovery


class _Watch:
    def __init__(self, begun: bool) -> None:
        self.answer = begun

    def begun(self) -> bool:
        return self.answer


def test_the_newest_live_watch_is_asked_and_none_once_all_are_gone() -> None:
    first, second = _Watch(False), _Watch(True)
    watch_for_regroups(first)
    watch_for_regroups(second)
    assert watching() and regroup_begun()  # the newest
    del second
    gc.collect()
    assert watching() and not regroup_begun()  # the one before, still alive
    del first
    gc.collect()
    assert not watching() and waiting._watches == []


@pytest.mark.usefixtures("one_rank")
def test_a_recovery_done_and_collected_leaves_no_watch_and_no_hook() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 2))
    model = gradsync.DistributedDataParallel(nn.Linear(3, 2), reduction="item_mean")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = dict(opt._optimizer_step_pre_hooks)
    recovery = Recovery(model, opt, GlobalBatchSampler(data, 4))
    assert watching() and not regroup_begun()
    for step in recovery.steps(2):
        with step:
            for x, y in step.micro_batches(DataLoader(data)):
                loss = ((model(x) - y) ** 2).sum()
                model.count_items(len(x))
                loss.backward()
            opt.step()
            opt.zero_grad()
    assert recovery.completed == 2 and len(opt._optimizer_step_pre_hooks) == len(hooks) + 1
    del recovery, step
    gc.collect()
    assert not watching() and waiting._watches == []
    assert dict(opt._optimizer_step_pre_hooks) == hooks  # the undo copy is no longer taken
