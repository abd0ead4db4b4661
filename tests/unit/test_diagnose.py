"""Diagnoses are pure: each known cause is recognised from hand-made evidence, no ranks needed."""

from __future__ import annotations

import math

import pytest

from gradsync.verify.diagnose import (
    DATA_MISMATCH,
    INIT_DIFFERS,
    MEAN_NOT_SUM,
    NO_SET_EPOCH,
    REPLICAS_DIFFER,
    SAME_DATA,
    SUM_NOT_MEAN,
    UNEXPLAINED,
    Evidence,
    StepRecord,
    diagnose,
    epoch_order_fingerprints,
    first_divergence,
    samples_fingerprint,
)

TOL = 1e-4
STEPS, SPE, GLOBAL = 6, 3, 6  # 2 epochs of 3 steps, 6 samples per global batch


def _epoch_order(epoch: int) -> list[str]:
    """Sample ids of one epoch in a shuffled order that differs per epoch."""
    n = SPE * GLOBAL
    return [f"s{(7 * i + 5 * epoch) % n}" for i in range(n)]


def _ref_batch(step: int, epoch: int | None = None) -> list[str]:
    """The global batch at ``step``, taken from ``epoch`` (default: the step's own epoch)."""
    b = step % SPE
    return _epoch_order(step // SPE if epoch is None else epoch)[b * GLOBAL : (b + 1) * GLOBAL]


def clean(world: int = 2, steps: int = STEPS) -> Evidence:
    """Evidence of a correct run: round-robin shards of each global batch, equal replicas."""
    records = [
        StepRecord(s, 3.0 - 0.1 * s, 3.0 - 0.1 * s, 3e-8, 1e-7, 1.0, 1.0) for s in range(steps)
    ]
    ref = [_ref_batch(s) for s in range(steps)]
    return Evidence(
        world_size=world,
        records=records,
        ref_init_checksum="aaaa",
        rank_init_checksums=["aaaa"] * world,
        ref_samples=ref,
        rank_samples=[[batch[r::world] for r in range(world)] for batch in ref],
        steps_per_epoch=SPE,
    )


def diverge_from(ev: Evidence, step: int, diff: float = 1e-2, ratio: float = 1.1) -> None:
    for r in ev.records[step:]:
        r.max_param_diff = r.max_grad_diff = diff
        r.grad_ratio = r.update_ratio = ratio


def causes(ev: Evidence) -> list[str]:
    return [d.cause for d in diagnose(ev, TOL)]


def test_clean_run_has_no_diagnosis_and_no_divergence() -> None:
    ev = clean()
    assert causes(ev) == []
    assert first_divergence(ev, TOL) is None


def test_divergence_is_the_first_step_past_tolerance_in_any_quantity() -> None:
    ev = clean()
    ev.records[2].max_grad_diff = 2 * TOL
    ev.records[4].max_param_diff = 2 * TOL
    assert first_divergence(ev, TOL) == 2


def test_nan_counts_as_diverged() -> None:
    ev = clean()
    ev.records[1].max_param_diff = math.nan
    assert first_divergence(ev, TOL) == 1


def test_loss_is_compared_relative_to_its_size() -> None:
    # A summed loss of 3000 differs by 1e-2 from fp32 rounding alone (1e-7 relative per term
    # over thousands of tokens): relative 3e-6, within 1e-4. An absolute 1e-2 on a loss of 3 is not.
    ev = clean()
    ev.records[0].ref_loss, ev.records[0].loss = 3000.0, 3000.01
    assert first_divergence(ev, TOL) is None
    ev.records[1].loss += 1e-2
    assert first_divergence(ev, TOL) == 1


def test_gradients_of_a_summed_loss_are_compared_relative_to_their_size() -> None:
    # A loss summed over 192 tokens has gradients of ~100: fp32 rounding alone differs by 1e-5.
    ev = clean()
    ev.records[0].grad_scale, ev.records[0].max_grad_diff = 100.0, 1e-5
    assert first_divergence(ev, TOL) is None
    ev.records[1].max_grad_diff = 1e-3  # of gradients below 1: past 1e-4
    assert first_divergence(ev, TOL) == 1


def test_replicas_that_differ_at_step_0_are_named_and_hide_the_gradient_ratio() -> None:
    ev = clean()
    ev.rank_init_checksums = ["aaaa", "bbbb"]
    diverge_from(ev, 0, ratio=2.0)  # a ratio of N here would be a coincidence, not a cause
    [d] = diagnose(ev, TOL)
    assert d.cause == REPLICAS_DIFFER
    assert "rank 1 bbbb" in d.evidence[0]


def test_equal_replicas_that_start_elsewhere_than_the_reference() -> None:
    ev = clean()
    ev.rank_init_checksums = ["bbbb", "bbbb"]
    diverge_from(ev, 0)
    assert causes(ev) == [INIT_DIFFERS]


def test_every_rank_given_the_same_data() -> None:
    ev = clean()
    ev.rank_samples = [[ranks[0]] * 2 for ranks in ev.rank_samples]
    diverge_from(ev, 0)
    # Not also "data mismatch": the duplicated shard explains why the union is wrong.
    assert causes(ev) == [SAME_DATA]


def test_same_data_is_reported_even_within_tolerance() -> None:
    ev = clean()
    ev.rank_samples = [[ranks[0]] * 2 for ranks in ev.rank_samples]
    assert causes(ev) == [SAME_DATA]
    assert first_divergence(ev, TOL) is None


def test_a_single_identical_step_is_not_same_data() -> None:
    ev = clean()
    ev.rank_samples[0] = [ev.rank_samples[0][0]] * 2
    assert SAME_DATA not in causes(ev)


def _without_set_epoch(ev: Evidence) -> None:
    """The N-rank run replays epoch 0's batches in every epoch."""
    world = ev.world_size
    for s in range(len(ev.rank_samples)):
        batch = _ref_batch(s, epoch=0)
        ev.rank_samples[s] = [batch[r::world] for r in range(world)]


def test_same_order_every_epoch() -> None:
    ev = clean()
    _without_set_epoch(ev)
    diverge_from(ev, SPE)
    [d] = diagnose(ev, TOL)
    assert d.cause == NO_SET_EPOCH
    assert "per epoch" in d.evidence[0]


def test_same_order_every_epoch_in_a_run_that_ends_mid_epoch() -> None:
    ev = clean(steps=SPE + 1)
    _without_set_epoch(ev)
    diverge_from(ev, SPE)
    assert causes(ev) == [NO_SET_EPOCH]


def test_without_steps_per_epoch_a_repeated_epoch_is_a_data_mismatch() -> None:
    ev = clean()
    _without_set_epoch(ev)
    ev.steps_per_epoch = None
    diverge_from(ev, SPE)
    assert causes(ev) == [DATA_MISMATCH]


def test_shards_that_do_not_add_up_to_the_global_batch() -> None:
    ev = clean()
    ev.rank_samples[2][1] = ev.rank_samples[2][1][:-1]  # rank 1 drops a sample at step 2
    diverge_from(ev, 2)
    [d] = diagnose(ev, TOL)
    assert d.cause == DATA_MISMATCH
    assert "first step 2" in d.evidence[0] and "[3, 2]" in d.evidence[0]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gradients_summed_not_averaged(world: int) -> None:
    ev = clean(world)
    diverge_from(ev, 0, ratio=float(world))
    [d] = diagnose(ev, TOL)
    assert d.cause == SUM_NOT_MEAN
    assert d.summary.startswith(f"updates {world} times too large")


def test_summed_gradients_under_adam_are_named_though_the_update_looks_right() -> None:
    ev = clean()
    diverge_from(ev, 0, ratio=2.0)
    ev.records[0].update_ratio = 1.0  # Adam: m / sqrt(v) does not change when g doubles
    [d] = diagnose(ev, TOL)
    assert d.cause == SUM_NOT_MEAN
    assert "Adam" in d.evidence[1]


def test_gradients_averaged_for_a_summed_loss() -> None:
    ev = clean(world=4)
    diverge_from(ev, 0, ratio=0.25)
    assert causes(ev) == [MEAN_NOT_SUM]


def test_a_ratio_near_1_is_not_a_reduction_bug() -> None:
    ev = clean()
    diverge_from(ev, 0, ratio=1.03)
    assert causes(ev) == [UNEXPLAINED]


def test_divergence_with_clean_evidence_is_unexplained_and_says_where() -> None:
    ev = clean()
    diverge_from(ev, 4)
    [d] = diagnose(ev, TOL)
    assert d.cause == UNEXPLAINED
    assert d.summary.startswith("diverged at step 4")
    assert "BatchNorm" in d.fix and "dropout" in d.fix


def test_samples_fingerprint_ignores_order_inside_a_batch_but_not_content() -> None:
    assert samples_fingerprint(["a", "b", "c"]) == samples_fingerprint(["c", "a", "b"])
    assert samples_fingerprint(["a", "b"]) != samples_fingerprint(["a", "b", "b"])


def test_epoch_order_fingerprints_cover_a_partial_last_epoch() -> None:
    fps = ["x", "y", "z", "x", "y"]
    a, b = epoch_order_fingerprints(fps, 3)
    assert a != b
    assert epoch_order_fingerprints(fps[:3] * 2, 3) == [a, a]
