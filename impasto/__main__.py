"""`python -m impasto ...`: the same command line as `impasto ...`."""

import sys

from impasto.entrypoints.cli import main

sys.exit(main())
