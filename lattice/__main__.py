"""`python -m lattice ...` is the `lattice` command (see lattice/cli/main.py)."""

import sys

from lattice.cli.main import main

sys.exit(main())
