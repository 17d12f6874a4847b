"""``python -m hot`` / the ``hot`` console script."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from hot.cli import main as _main

    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
