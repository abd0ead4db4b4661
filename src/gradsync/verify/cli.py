"""``gradsync verify``: the command line. ``add_arguments`` and ``run`` plug into any parser.

It only parses arguments, runs :func:`~gradsync.verify.runner.verify` and prints
:func:`~gradsync.verify.report.format_report`.

Exit codes: 0 when N-rank training matches 1-process training, 1 when it does not (or a known
bug shows in the evidence), 2 when the check could not run (bad arguments, a rank failed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from gradsync.ddp.plan import parse_cap
from gradsync.errors import SpawnError
from gradsync.verify.inject import INJECTIONS
from gradsync.verify.report import format_report
from gradsync.verify.runner import DEFAULT_LR, OPTIMIZERS, FactoryError, VerifyConfig, verify

DESCRIPTION = """\
Is my N-process training the same as 1-process training? Trains the model in one process on
each global batch and on N gloo ranks with gradsync on the ranks' shards of it, compares loss,
gradients and parameters after every step, and names the likely cause when they differ.

Factory contracts ("module:function", imported with the current directory on sys.path):
  --model    () -> nn.Module. torch is seeded (seed + rank) before the call.
  --batches  (rank, world_size, step) -> tuple of tensors, sample dimension first: rank's shard
             of global step `step`. (0, 1, step) is the whole global batch, and the ranks'
             shards of a step hold exactly its samples (a DistributedSampler with
             set_epoch(step // steps_per_epoch) does). An int attribute `steps_per_epoch` on it
             stands in for --steps-per-epoch.
  --loss     (model, batch) -> scalar loss, reduced as --reduction says. Default:
             cross-entropy of model(*batch[:-1]) against batch[-1].
"""


# Checked at parse time, so a bad value is an argparse error naming the option (exit 2): a NaN
# learning rate or tolerance would otherwise run and be misdiagnosed as a divergence (exit 1).
def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _number(text: str, *, zero_ok: bool, what: str = "a finite number") -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise argparse.ArgumentTypeError(
            f"must be {what} {'>=' if zero_ok else '>'} 0, got {text!r}"
        )
    return value


def _positive(text: str) -> float:
    return _number(text, zero_ok=False)


def _non_negative(text: str) -> float:
    return _number(text, zero_ok=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``verify`` options to ``parser``."""
    d = VerifyConfig()
    parser.add_argument("--model", default=d.model, metavar="MODULE:FN", help="model factory")
    parser.add_argument("--batches", default=d.batches, metavar="MODULE:FN", help="batch factory")
    parser.add_argument(
        "--loss", default=None, metavar="MODULE:FN", help="loss (default: cross-entropy)"
    )
    parser.add_argument(
        "-n", "--world-size", type=_count, default=d.world_size, help="ranks (default: %(default)s)"
    )
    parser.add_argument("--steps", type=_count, default=d.steps, help="default: %(default)s")
    parser.add_argument(
        "--steps-per-epoch",
        type=_count,
        default=None,
        help="steps in one epoch of the batch factory (for the epoch-order check and "
        "--inject no-set-epoch; the built-in has 3)",
    )
    _add_training_arguments(parser, d)
    parser.add_argument(
        "--tp", type=_count, default=1, help="tensor-parallel ranks (built-in GPT only)"
    )
    parser.add_argument(
        "--cp",
        type=_count,
        default=1,
        help="context-parallel ranks (built-in GPT only); dp is the world size / (cp * tp)",
    )
    parser.add_argument(
        "--tolerance",
        type=_non_negative,
        default=d.tolerance,
        help="largest difference allowed in loss, gradients and parameters at any step "
        "(absolute below 1, relative above). fp32 rounding across ranks gives ~1e-7 per step "
        "on the built-in model; every injected bug moves gradients by over 1e-2 "
        "(default: %(default)g)",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="default: %(default)s")
    parser.add_argument(
        "--inject",
        choices=sorted(INJECTIONS),
        default=None,
        help="reproduce a classic bug in the N-rank run only, to see its diagnosis: "
        + "; ".join(f"{k}: {v}" for k, v in INJECTIONS.items()),
    )
    parser.add_argument(
        "--timeout-s", type=_positive, default=d.timeout_s, help="limit for the N-rank run"
    )


def _add_training_arguments(parser: argparse.ArgumentParser, d: VerifyConfig) -> None:
    """The optimizer, learning rate, loss reduction and bucket cap of both runs."""
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help="sgd (default): plain SGD, whose update is lr * grad, so any gradient error shows "
        "in the weights. adamw: Adam divides each update by the gradient's running scale, so it "
        "is nearly invariant to gradient scale and hides a sum-vs-mean bug in the weights "
        "(verify still sees it in the gradients)",
    )
    parser.add_argument(
        "--lr",
        type=_positive,
        default=None,
        help=f"learning rate (default: {DEFAULT_LR['sgd']} for sgd, "
        f"{DEFAULT_LR['adamw']} for adamw)",
    )
    parser.add_argument(
        "--reduction",
        choices=("mean", "sum"),
        default=d.reduction,
        help="how the loss is reduced over samples, passed to gradsync (default: %(default)s)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=parse_cap,
        default=d.bucket_cap_mb,
        help="gradsync bucket cap in MiB; 'none': one bucket; 'scaled' or 'auto' "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--deterministic",
        type=_count,
        default=None,
        metavar="LEAVES",
        help="verify gradsync's deterministic mode with LEAVES leaves per step against its "
        "definition (each leaf's backward, the fixed tree), bit for bit",
    )


def config_from_args(args: argparse.Namespace) -> VerifyConfig:
    return VerifyConfig(
        model=args.model,
        batches=args.batches,
        loss=args.loss,
        world_size=args.world_size,
        steps=args.steps,
        steps_per_epoch=args.steps_per_epoch,
        optimizer=args.optimizer,
        lr=args.lr,
        reduction=args.reduction,
        bucket_cap_mb=args.bucket_cap_mb,
        tolerance=args.tolerance,
        seed=args.seed,
        inject=args.inject,
        timeout_s=args.timeout_s,
        deterministic=args.deterministic,
    )


def _factory_fault(exc: FactoryError) -> str:
    """``exc`` in terms of the command line: the option and the value it was given."""
    if exc.spec is None:  # no --loss: the default loss does not fit the model or the batches
        return (
            f"--loss not given: the default (cross-entropy of model(*batch[:-1]) against "
            f"batch[-1]): {exc.problem}"
        )
    return f"--{exc.field} {exc.spec}: {exc.problem}"


def run(args: argparse.Namespace) -> int:
    """Run ``gradsync verify`` from parsed arguments; return the exit code."""
    # Like `python -m`: factories in the user's project import without installing it. Spawned
    # ranks inherit sys.path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args.tp > 1 or args.cp > 1:
        return _run_mesh(args)
    try:
        report = verify(config_from_args(args))
    except FactoryError as exc:
        print(f"gradsync verify: error: {_factory_fault(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"gradsync verify: error: {exc}", file=sys.stderr)
        return 2
    except SpawnError as exc:
        print(f"gradsync verify: the N-rank run failed: {exc}", file=sys.stderr)
        return 2
    print(format_report(report), flush=True)
    return 0 if report.passed else 1


def _run_mesh(args: argparse.Namespace) -> int:
    """``--tp`` / ``--cp``: the built-in GPT on a (dp, cp, tp) mesh (``verify/mesh.py``)."""
    from gradsync.verify import mesh

    d = VerifyConfig()
    custom = [
        f"--{name}"
        for name in ("model", "batches", "loss", "inject", "steps_per_epoch", "deterministic")
        if getattr(args, name) != getattr(d, name)
    ]
    try:
        if custom:
            raise ValueError(
                f"--tp/--cp verify the built-in GPT (their tensor-parallel plan is written for "
                f"it); drop {', '.join(custom)}"
            )
        report = mesh.MeshReport(
            mesh.check_layout(args.world_size, args.cp, args.tp),
            args.steps,
            args.optimizer,
            mesh.default_lr(args.optimizer, args.lr),
            args.reduction,
            args.bucket_cap_mb,
            args.tolerance,
        )
    except ValueError as exc:
        print(f"gradsync verify: error: {exc}", file=sys.stderr)
        return 2
    try:
        mesh.verify_mesh(report, seed=args.seed, timeout_s=args.timeout_s)
    except SpawnError as exc:
        print(f"gradsync verify: the N-rank run failed: {exc}", file=sys.stderr)
        return 2
    print(mesh.format_mesh_report(report), flush=True)
    return 0 if report.passed else 1
