"""python -m lattice.bench: `lattice bench` without the CLI."""

import sys

from lattice.bench import main

sys.exit(main())
