"""`python -m specfleet.distill ...`: the `specfleet distill` command on its own."""
import sys

from specfleet.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["distill", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
