"""The ``gradsync`` command: ``gradsync verify``, ``gradsync bench`` and ``gradsync cluster``.

This and ``python -m gradsync`` are the only entry points. Each verb lives next to what it drives
(``verify/cli.py``, ``bench/cli.py``, ``testing/cluster.py``) and exposes ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> exit code``; this module only routes.
"""

from __future__ import annotations

import argparse

from gradsync.bench import cli as bench_cli
from gradsync.testing import cluster as cluster_cli
from gradsync.verify import cli as verify_cli

SUBCOMMANDS = {
    "verify": (verify_cli, "is my N-process training the same as 1-process training?"),
    "bench": (bench_cli, "step time against torch DDP, overlap and bus bandwidth; --trace"),
    "cluster": (cluster_cli, "run a torchrun script across simulated nodes (needs root)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync", description="Data-parallel training that equals one-device training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, summary) in SUBCOMMANDS.items():
        command = sub.add_parser(
            name,
            help=summary,
            description=module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))
