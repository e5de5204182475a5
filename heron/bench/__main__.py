"""``python -m heron.bench SUBCOMMAND ...``: ``heron bench`` without the ``heron`` command, so
that the harness copied into an older source tree measures that tree."""

import argparse
import sys

from heron.bench.cli import add_bench_parser, run
from heron.cli import add_engine_args, engine_config


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m heron.bench", description=__doc__)
    add_bench_parser(parser, add_engine_args)
    args = parser.parse_args()
    config = engine_config(args) if hasattr(args, "model") else None
    return run(args, config, ["bench", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
