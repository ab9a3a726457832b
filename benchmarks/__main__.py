"""`python -m benchmarks suite SUITE --cluster PRESET` (same as `autopar bench`)."""

from __future__ import annotations

import sys

from autopar.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[2:]] if sys.argv[1:2] == ["suite"] else ["bench",
                                                                                *sys.argv[1:]]))
