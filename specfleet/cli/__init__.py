"""The `specfleet` command line: main (generate and the sub-command table), common engine
arguments, serve, ngram and the terminal display of statistics and token origins."""


def main(argv: list[str] | None = None) -> int:
    """The console entry point; imports the sub-commands only when called."""
    from specfleet.cli.main import main as run

    return run(argv)
