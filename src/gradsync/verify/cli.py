"""``gradsync verify``: the command line. ``add_arguments`` and ``run`` plug into any parser.

It only parses arguments, runs :func:`~gradsync.verify.runner.verify` and prints
:func:`~gradsync.verify.report.format_report`.

Exit codes: 0 when N-rank training matches 1-process training, 1 when it does not (or a known
bug shows in the evidence), 2 when the check could not run (bad arguments, a rank failed).
"""

from __future__ import annotations

import argparse
import os
import sys

from gradsync.errors import SpawnError
from gradsync.verify.inject import INJECTIONS
from gradsync.verify.report import format_report
from gradsync.verify.runner import DEFAULT_LR, OPTIMIZERS, VerifyConfig, verify

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


def _cap(value: str) -> float | None:
    return None if value.lower() == "none" else float(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``verify`` options to ``parser``."""
    d = VerifyConfig()
    parser.add_argument("--model", default=d.model, metavar="MODULE:FN", help="model factory")
    parser.add_argument("--batches", default=d.batches, metavar="MODULE:FN", help="batch factory")
    parser.add_argument(
        "--loss", default=None, metavar="MODULE:FN", help="loss (default: cross-entropy)"
    )
    parser.add_argument(
        "-n", "--world-size", type=int, default=d.world_size, help="ranks (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=d.steps, help="default: %(default)s")
    parser.add_argument(
        "--steps-per-epoch",
        type=int,
        default=None,
        help="steps in one epoch of the batch factory (for the epoch-order check and "
        "--inject no-set-epoch; the built-in has 3)",
    )
    _add_training_arguments(parser, d)
    parser.add_argument(
        "--tolerance",
        type=float,
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
        "--timeout-s", type=float, default=d.timeout_s, help="limit for the N-rank run"
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
        type=float,
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
        type=_cap,
        default=d.bucket_cap_mb,
        help="gradsync bucket cap in MiB; 'none': one bucket (default: %(default)s)",
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
    )


def run(args: argparse.Namespace) -> int:
    """Run ``gradsync verify`` from parsed arguments; return the exit code."""
    # Like `python -m`: factories in the user's project import without installing it. Spawned
    # ranks inherit sys.path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        report = verify(config_from_args(args))
    except ValueError as exc:
        print(f"gradsync verify: error: {exc}", file=sys.stderr)
        return 2
    except SpawnError as exc:
        print(f"gradsync verify: the N-rank run failed: {exc}", file=sys.stderr)
        return 2
    print(format_report(report), flush=True)
    return 0 if report.passed else 1
