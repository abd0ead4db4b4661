"""``python -m gradsync <verb>``: the same command as ``gradsync <verb>``."""

from __future__ import annotations

import sys

from gradsync.cli import main

if __name__ == "__main__":
    sys.exit(main())
