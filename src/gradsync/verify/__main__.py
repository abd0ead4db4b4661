"""``python -m gradsync.verify``: the same command as ``gradsync verify``."""

from __future__ import annotations

import sys

from gradsync.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
