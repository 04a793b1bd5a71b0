"""`python -m specfleet.distill ...`: the `specfleet distill` command on its own."""
import argparse
import logging
import sys

from specfleet.distill.cli import add_distill_parser
from specfleet.errors import SpecfleetError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specfleet")
    sub = parser.add_subparsers(dest="command", required=True)
    add_distill_parser(sub)
    args = parser.parse_args(["distill", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="specfleet: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except SpecfleetError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
