"""``gradsync verify``: is N-process training with gradsync the same as 1-process training?

It trains a model twice from the same weights: in one process on each global batch, and on N
spawned gloo ranks with :class:`gradsync.DistributedDataParallel` on the ranks' shards. It
compares loss, gradients and parameters after every step and, when they differ, names the likely
cause from what it recorded: per-rank batch fingerprints, per-epoch sample orders, per-rank
parameter checksums before the first step, and the N-rank gradient's scale relative to the
reference's. ``inject`` reproduces the classic bugs on purpose.

    from gradsync.verify import VerifyConfig, verify, format_report
    report = verify(VerifyConfig(model="mypkg.train:make_model", batches="mypkg.train:batch"))
    print(format_report(report)); assert report.passed

The factory contracts are documented on :class:`VerifyConfig`; ``gradsync.verify.builtin`` is a
worked example (a tiny GPT on a generated corpus, sharded by a ``DistributedSampler``).
"""

from gradsync.verify.diagnose import Diagnosis, Evidence, StepRecord, diagnose
from gradsync.verify.inject import INJECTIONS
from gradsync.verify.report import format_report
from gradsync.verify.runner import VerifyConfig, VerifyReport, verify

__all__ = [
    "INJECTIONS",
    "Diagnosis",
    "Evidence",
    "StepRecord",
    "VerifyConfig",
    "VerifyReport",
    "diagnose",
    "format_report",
    "verify",
]
