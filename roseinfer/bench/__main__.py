"""`python -m roseinfer.bench offline ...` is `roseinfer bench offline ...`."""

import sys

from roseinfer.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
