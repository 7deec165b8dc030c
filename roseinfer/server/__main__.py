"""The seed's spelling: `python -m roseinfer.server --checkpoint-path ... --port ...`."""

import sys

from roseinfer.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", *sys.argv[1:]]))
