"""From the evidence of a verify run to the likely cause of a divergence: pure functions.

The runner records, for the reference and for the N-rank run, what each step was fed and what it
did (see :class:`Evidence`). Each check below reads one kind of evidence and names one classic
data-parallel bug; none needs a process group or a model, so each is unit-tested on hand-made
evidence. The checks are ordered so that a cause explains away its symptoms: when replicas start
different, gradient ratios mean nothing; when every rank gets the same data, the shards cannot
add up to the global batch either.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Causes, as named in reports and tests.
REPLICAS_DIFFER = "replicas-differ"
INIT_DIFFERS = "init-differs"
SAME_DATA = "same-data"
NO_SET_EPOCH = "no-set-epoch"
DATA_MISMATCH = "data-mismatch"
SUM_NOT_MEAN = "sum-not-mean"
MEAN_NOT_SUM = "mean-not-sum"
UNEXPLAINED = "unexplained"

# A summed gradient is N times the averaged one up to fp32 rounding (~1e-7 relative); 2% leaves
# room for a loss that is only nearly mean-reduced and still rules out an honest ratio of 1.
RATIO_RTOL = 0.02


@dataclass
class StepRecord:
    """One optimizer step: the reference's numbers next to the N-rank run's."""

    step: int
    ref_loss: float
    loss: float
    """The N-rank loss: the mean of the ranks' losses ("mean" reduction) or their sum ("sum")."""
    max_param_diff: float
    """max over ranks and elements of |param - reference param| after the step."""
    max_grad_diff: float
    """max over ranks and elements of |synchronised grad - reference grad| at the step."""
    grad_ratio: float
    """||grad|| / ||reference grad|| on rank 0: N when gradients are summed instead of averaged."""
    update_ratio: float
    """||param change|| / ||reference param change|| on rank 0 (near 1 under Adam whatever the
    gradient scale, which is why Adam hides a sum-vs-mean bug)."""
    param_scale: float = 1.0
    """max |reference param| after the step."""
    grad_scale: float = 1.0
    """max |reference grad| at the step (large for a loss summed over a big batch)."""


@dataclass
class Evidence:
    """What a verify run saw. Fingerprints are hex digests: equal means byte-for-byte equal."""

    world_size: int
    records: list[StepRecord]
    ref_init_checksum: str
    """Checksum of the reference's parameters before the first step."""
    rank_init_checksums: list[str]
    """Checksum of each rank's parameters before the first step (after wrapping)."""
    ref_samples: list[list[str]]
    """[step] -> fingerprints of the samples of the reference's (global) batch."""
    rank_samples: list[list[list[str]]]
    """[step][rank] -> fingerprints of the samples of that rank's batch."""
    steps_per_epoch: int | None = None
    """Steps in one epoch of the batch factory, when known: enables the epoch-order check."""


@dataclass
class Diagnosis:
    """A likely cause, the evidence that points to it, and what to change."""

    cause: str
    summary: str
    evidence: list[str] = field(default_factory=list)
    fix: str = ""


def fingerprint(items: Sequence[str]) -> str:
    """A short digest of a sequence of fingerprints (order matters)."""
    h = hashlib.blake2b(digest_size=6)
    for item in items:
        h.update(item.encode())
        h.update(b",")
    return h.hexdigest()


def samples_fingerprint(samples: Sequence[str]) -> str:
    """The digest of a batch as a multiset: the order of samples inside a batch does not matter
    (the ranks' shards interleave the reference's batch)."""
    return fingerprint(sorted(samples))


def union_fingerprints(ev: Evidence) -> list[str]:
    """Per step: the digest of all ranks' samples taken together."""
    return [samples_fingerprint([s for shard in ranks for s in shard]) for ranks in ev.rank_samples]


def reference_fingerprints(ev: Evidence) -> list[str]:
    return [samples_fingerprint(samples) for samples in ev.ref_samples]


def epoch_order_fingerprints(step_fps: Sequence[str], steps_per_epoch: int) -> list[str]:
    """Per epoch: the digest of its sequence of batches (the sample order of the epoch at batch
    granularity). A last, partial epoch gets a digest of the steps it has."""
    return [
        fingerprint(step_fps[i : i + steps_per_epoch])
        for i in range(0, len(step_fps), steps_per_epoch)
    ]


def diverged(record: StepRecord, tolerance: float) -> bool:
    """Whether a step is past ``tolerance``. Written as ``not <=`` so that NaN counts as diverged.

    Each quantity is compared absolutely below 1 and relative to its largest reference value
    above: fp32 rounding is relative, and a loss summed over a batch (with its gradients) grows
    with the batch, while most parameters and mean-loss gradients are below 1.
    """
    return not (
        record.max_param_diff <= tolerance * max(1.0, record.param_scale)
        and record.max_grad_diff <= tolerance * max(1.0, record.grad_scale)
        and abs(record.loss - record.ref_loss) <= tolerance * max(1.0, abs(record.ref_loss))
    )


def first_divergence(ev: Evidence, tolerance: float) -> int | None:
    """The first step past ``tolerance``, or ``None`` when every step is within it."""
    for record in ev.records:
        if diverged(record, tolerance):
            return record.step
    return None


def _check_replicas(ev: Evidence) -> Diagnosis | None:
    sums = ev.rank_init_checksums
    if len(set(sums)) > 1:
        differ = [r for r, s in enumerate(sums) if s != sums[0]]
        return Diagnosis(
            REPLICAS_DIFFER,
            "replicas different at step 0: the initial state was not broadcast",
            [
                "parameter checksums before the first step: "
                + ", ".join(f"rank {r} {s}" for r, s in enumerate(sums))
                + f" (reference {ev.ref_init_checksum})",
                f"ranks {differ} start from other weights than rank 0; averaged gradients keep "
                "the difference forever",
            ],
            "wrap the model in gradsync.DistributedDataParallel (it broadcasts rank 0's "
            "parameters and buffers at construction), or seed every rank identically",
        )
    if sums and sums[0] != ev.ref_init_checksum:
        return Diagnosis(
            INIT_DIFFERS,
            "the N-rank run starts from other weights than the 1-process reference",
            [f"checksums before the first step: ranks {sums[0]}, reference {ev.ref_init_checksum}"],
            "make the model factory deterministic given torch.manual_seed (the runner seeds "
            "torch before calling it); do not load rank-specific state in it",
        )
    return None


def _check_same_data(ev: Evidence) -> Diagnosis | None:
    if ev.world_size < 2 or not ev.rank_samples:
        return None
    same = [
        step
        for step, ranks in enumerate(ev.rank_samples)
        if len({samples_fingerprint(shard) for shard in ranks}) == 1
    ]
    # Two disjoint shards of a shuffled dataset are identical only by accident: half the steps
    # is no accident.
    if 2 * len(same) < len(ev.rank_samples):
        return None
    return Diagnosis(
        SAME_DATA,
        "every rank given the same data: the global batch is one shard repeated",
        [
            f"at {len(same)} of {len(ev.rank_samples)} steps every rank's batch had the same "
            f"fingerprint (step {same[0]}: {samples_fingerprint(ev.rank_samples[same[0]][0])} on "
            f"all {ev.world_size} ranks)"
        ],
        "give each rank its own shard: DistributedSampler(dataset, num_replicas=world_size, "
        "rank=rank) in the DataLoader",
    )


def _check_epoch_order(ev: Evidence) -> Diagnosis | None:
    spe = ev.steps_per_epoch
    n = len(ev.rank_samples)
    if spe is None or n <= spe:
        return None
    union, ref = union_fingerprints(ev), reference_fingerprints(ev)
    later = range(spe, n)
    repeats = all(union[s] == union[s - spe] for s in later)
    ref_repeats = all(ref[s] == ref[s - spe] for s in later)
    if not repeats or ref_repeats:
        return None
    return Diagnosis(
        NO_SET_EPOCH,
        "the same sample order every epoch: the sampler's epoch never advances",
        [
            f"sample-order fingerprints per epoch ({spe} steps each): N-rank run "
            f"{epoch_order_fingerprints(union, spe)}, "
            f"reference {epoch_order_fingerprints(ref, spe)}",
            f"from step {spe} on, each N-rank batch repeats the one {spe} steps earlier",
        ],
        "call sampler.set_epoch(epoch) at the start of every epoch, on every rank",
    )


def _check_data_matches(ev: Evidence) -> Diagnosis | None:
    union, ref = union_fingerprints(ev), reference_fingerprints(ev)
    bad = [s for s, (u, r) in enumerate(zip(union, ref, strict=True)) if u != r]
    if not bad:
        return None
    s = bad[0]
    sizes = [len(shard) for shard in ev.rank_samples[s]]
    return Diagnosis(
        DATA_MISMATCH,
        "the ranks' batches do not add up to the reference's global batch",
        [
            f"at {len(bad)} of {len(ref)} steps, first step {s}: union of the ranks' samples "
            f"{union[s]} ({sum(sizes)} samples, per rank {sizes}), reference {ref[s]} "
            f"({len(ev.ref_samples[s])} samples)"
        ],
        "the batch factory must return rank r's shard of global step s, such that the ranks' "
        "shards together are exactly batch_fn(0, 1, s)",
    )


def _check_grad_scale(ev: Evidence) -> Diagnosis | None:
    if ev.world_size < 2 or not ev.records:
        return None
    # Step 0 only: the replicas and the reference hold the same weights and data there, so the
    # ratio is the reduction's scale and nothing else.
    first = ev.records[0]
    n = ev.world_size
    ratio_text = (
        f"step 0: ||grad|| / ||reference grad|| = {first.grad_ratio:.4g}, "
        f"||update|| / ||reference update|| = {first.update_ratio:.4g} with {n} ranks"
    )
    if math.isclose(first.grad_ratio, n, rel_tol=RATIO_RTOL):
        if math.isclose(first.update_ratio, n, rel_tol=RATIO_RTOL):
            summary = f"updates {n} times too large: gradients summed over ranks, not averaged"
            note = f"the update follows the gradient (plain SGD: lr * grad), so {n}x too far"
        else:
            summary = f"gradients {n} times too large: summed over ranks, not averaged"
            note = (
                "the optimizer divides out the gradient's scale (Adam does), so the weights "
                "and the loss hardly show it; gradient clipping and weight decay still see it"
            )
        return Diagnosis(
            SUM_NOT_MEAN,
            summary,
            [ratio_text, note],
            "with a mean-reduced loss use reduction='mean' (the default); use reduction='sum' "
            "only with a loss summed over samples",
        )
    if math.isclose(first.grad_ratio, 1 / n, rel_tol=RATIO_RTOL):
        return Diagnosis(
            MEAN_NOT_SUM,
            f"updates {n} times too small: gradients averaged over ranks for a summed loss",
            [ratio_text],
            "with a loss summed over samples use reduction='sum'",
        )
    return None


def diagnose(ev: Evidence, tolerance: float) -> list[Diagnosis]:
    """Likely causes, most likely first; empty when the run is within tolerance and clean.

    Structural findings (different initial replicas, duplicated or repeated data) are reported
    even within tolerance: they are bugs that a short run or a forgiving optimizer can hide.
    """
    found: list[Diagnosis] = []
    replicas = _check_replicas(ev)
    if replicas is not None:
        found.append(replicas)
    data = _check_same_data(ev) or _check_epoch_order(ev) or _check_data_matches(ev)
    if data is not None:
        found.append(data)
    if replicas is None and data is None:
        scale = _check_grad_scale(ev)
        if scale is not None:
            found.append(scale)
    step = first_divergence(ev, tolerance)
    if step is not None and not found:
        r = ev.records[step]
        found.append(
            Diagnosis(
                UNEXPLAINED,
                f"diverged at step {step} with no known cause in the evidence",
                [
                    f"step {step}: loss {r.loss:.6g} vs {r.ref_loss:.6g}, max |param diff| "
                    f"{r.max_param_diff:.3g}, max |grad diff| {r.max_grad_diff:.3g}, grad ratio "
                    f"{r.grad_ratio:.4g} (tolerance {tolerance:g})",
                    "same initial weights, same samples and the gradient scale of averaging",
                ],
                "look for randomness in forward (dropout, random augmentation drawn per rank), "
                "BatchNorm statistics of per-rank batches, a loss reduced otherwise than "
                "--reduction says (e.g. a mean over a per-rank count of valid tokens), or a "
                "forward that depends on the rank",
            )
        )
    return found
