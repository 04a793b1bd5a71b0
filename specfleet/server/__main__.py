"""`python -m specfleet.server ...`: the same as `specfleet serve ...`."""
import sys

from specfleet.cli.serve import main

sys.exit(main())
