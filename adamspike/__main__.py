import sys

from adamspike.cli import main

sys.exit(main())
