"""``python -m gradsync.verify``: the same command as ``gradsync verify``."""

from __future__ import annotations

import argparse
import sys

from gradsync.verify.cli import DESCRIPTION, add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradsync.verify",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
