"""The step window's counts and phases, forward by forward ([Note: the step window])."""

from __future__ import annotations

from gradsync.ddp.window import Phase, StepWindow


def begin(window: StepWindow, sync: bool, training: bool = True) -> None:
    window.begin_forward(sync, training, num_active=2, by_world=False, changes=[])


def test_a_forward_may_change_its_decision_until_its_backward_begins() -> None:
    window = StepWindow(num_params=3, world_size=2)
    assert window.phase is Phase.UNPREPARED and not window.open
    begin(window, sync=False)
    assert (window.phase, window.forwards, window.no_sync) == (Phase.ACCUMULATING, 1, 1)
    window.decide(True)  # require_backward_grad_sync set while the module runs
    assert (window.phase, window.no_sync) == (Phase.ARMED, 0)
    window.decide(False)
    assert (window.phase, window.no_sync) == (Phase.ACCUMULATING, 1)
    assert window.backward_began() and not window.backward_began()  # first time only
    window.decide(True)  # too late: the backward is accumulating
    assert (window.phase, window.no_sync) == (Phase.ACCUMULATING, 1)


def test_a_window_counts_training_forwards_and_those_under_no_sync() -> None:
    window = StepWindow(num_params=3, world_size=2)
    begin(window, sync=False)
    window.backward_began()
    begin(window, sync=False, training=False)  # an eval forward is not counted
    begin(window, sync=False)
    begin(window, sync=True)
    assert (window.forwards, window.no_sync, window.open) == (3, 2, True)
    window.start_reduction()
    assert window.phase is Phase.REDUCING
    assert (window.forwards, window.no_sync) == (3, 2)  # what the step tag carries
    window.decide(False)  # inside the reduction nothing changes
    assert window.phase is Phase.REDUCING


def test_a_joined_rank_shadows_with_nothing_used() -> None:
    window = StepWindow(num_params=2, world_size=4)
    window.used[1] = True
    window.shadow(num_active=3, by_world=True, changes=["'w' requires_grad True -> False"])
    assert window.used == [False, False] and window.phase is Phase.REDUCING
    assert (window.num_active, window.by_world, window.forwards) == (3, True, 0)
