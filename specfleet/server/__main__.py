"""`python -m specfleet.server ...`: the same as `specfleet serve ...`."""
import sys

from specfleet.server.cli import main

sys.exit(main())
