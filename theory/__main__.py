"""python -m theory: see theory.cli."""

import sys

from .cli import main

sys.exit(main())
