"""The ``gradsync`` command: ``gradsync verify`` and ``gradsync bench``.

Each subcommand lives next to what it drives (``verify/cli.py``, ``bench/cli.py``) and exposes
``add_arguments(parser)`` and ``run(args) -> exit code``; this module only routes.
"""

from __future__ import annotations

import argparse
import sys

from gradsync.bench import cli as bench_cli
from gradsync.verify import cli as verify_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync", description="Data-parallel training that equals one-device training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="is my N-process training the same as 1-process training?",
        description=verify_cli.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify_cli.add_arguments(verify)
    verify.set_defaults(run=verify_cli.run)
    bench = sub.add_parser(
        "bench",
        help="step time against torch DDP, overlap efficiency and bus bandwidth",
        description=bench_cli.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_cli.add_arguments(bench)
    bench.set_defaults(run=bench_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
