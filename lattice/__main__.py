"""`python -m lattice ...` is the `lattice` command (see lattice/cli.py)."""

import sys

from lattice.cli import main

sys.exit(main())
