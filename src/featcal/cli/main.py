"""Entry point of the `featcal` command: dispatches to the sub-command modules."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from featcal.errors import FeatCalError

# sub-command modules, each with register(subparsers) setting `func` on its parser
COMMANDS = ("merge", "calibrate", "run", "zoo", "bench", "reproduce", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="featcal", description="Merge fine-tuned transformers and calibrate the merge toward its experts."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"featcal.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name == f"featcal.cli.{name}_cmd":
                continue  # sub-command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except FeatCalError as exc:
        print(f"featcal: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("featcal: interrupted; the output directory was left untouched.", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
