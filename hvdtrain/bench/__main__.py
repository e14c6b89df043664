"""`python -m hvdtrain.bench`: see `hvdtrain.bench` for the manual."""

import sys

from hvdtrain.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
