"""`python -m specfleet.bench ARGS` = `specfleet bench ARGS`."""
import sys

from specfleet.bench.cli import main

sys.exit(main())
