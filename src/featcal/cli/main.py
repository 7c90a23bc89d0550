"""Entry point of the `featcal` command: dispatches to the sub-command modules.

Start-up is kept short: only the command named on the line has its module imported and its flags built
(pydantic's schemas, and transformers / torch, load only where that command needs them), so `featcal --version`,
`featcal --help` and a mistyped command answer in a fraction of a second (tests/cli/test_start_up.py). An
argparse error prints two lines: the command's usage in short and the error (`Parser`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading

from featcal.cli import manners
from featcal.cli.commands import COMMANDS, HELP
from featcal.errors import FeatCalError
from featcal.io.process import host_allocator, interrupts
from featcal.io.process.interrupts import Terminated
from featcal.io.write.atomic import os_error_of


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose error is two lines: `usage: featcal CMD ARGS [options]` and the error, where
    argparse printed the command's whole usage (24 to 39 lines for calibrate) above it. --help is unchanged."""

    def short_usage(self) -> str:
        words = [self.prog]
        for action in self._actions:
            if action.option_strings:
                continue
            if isinstance(action, argparse._SubParsersAction):
                words.append("COMMAND ...")
            else:
                words.append(action.metavar or action.dest)
        return " ".join([*words, "[options]"])

    def error(self, message: str):
        self.exit(2, f"usage: {self.short_usage()}  ({self.prog} --help lists every option)\nfeatcal: error: {message}\n")


def chosen_command(argv: list[str]) -> str | None:
    """The sub-command named on the line (the first word that is one), None when there is none."""
    return next((word for word in argv if word in COMMANDS), None)


def build_parser(command: str | None = "") -> argparse.ArgumentParser:
    """The featcal parser. `command` "" (the default): every sub-command with all its flags; a command's
    name: that one only, the others listed by name and help (what `main` parses with); None: none in full."""
    parser = Parser(
        prog="featcal", description="Merge fine-tuned transformers and calibrate the merge toward its experts."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        if command not in ("", name):
            sub.add_parser(name, help=HELP[name])
            continue
        try:
            module = importlib.import_module(f"featcal.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name == f"featcal.cli.{name}_cmd":
                continue  # sub-command not built yet
            raise
        module.register(sub)
    manners.add_global_flags(parser)  # --version, --quiet, --log-level, --no-progress, --threads: every command
    return parser


def one_line(exc: BaseException) -> str:
    """The error message on one line (some come from libraries with paragraphs in them)."""
    return " ".join(str(exc).split())


def finished_message(args: argparse.Namespace) -> str:
    """What a command that ran to its end despite a SIGTERM left: its output is complete (written atomically)."""
    out = getattr(args, "out", None)
    return f"its output {out} is complete" if out and os.path.isdir(out) else "nothing was left half-done"


def interrupted_message(args: argparse.Namespace, exc: KeyboardInterrupt) -> str:
    """What an interrupt left behind, and how to carry on."""
    what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    out = getattr(args, "out", None)
    where = f"the output directory {out}" if out else "the output directory"
    head = f"featcal: {what}; {where} was left untouched (absent, or its previous content intact)"
    if getattr(args, "command", None) in ("calibrate", "run") and getattr(args, "cfg_resume", True):
        state = getattr(args, "cfg_resume_dir", None)
        if state is None and out:
            from featcal.calibration.resume.store import default_resume_dir

            state = default_resume_dir(out)
        kept = f" in {state}" if state else " beside the output"
        every = getattr(args, "cfg_checkpoint_every", 1)
        when = "every block" if every == 1 else f"every {every} blocks"
        return (
            f"{head}. Calibration keeps a checkpoint after {when}{kept}: rerunning the same command resumes "
            "after the last checkpointed block (or starts again if none was reached)."
        )
    return f"{head} and no temporary files remain. Nothing can be resumed: rerun the same command to start again."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(chosen_command(argv)).parse_args(argv)
    try:  # before any model is read: FEATCAL_HOST_ALLOCATOR=tuned keeps and reuses freed pages (io/process/host_allocator.py)
        applied = host_allocator.apply(host_allocator.requested())
    except ValueError as exc:
        print(f"featcal: error: {host_allocator.ENV}: {exc}", file=sys.stderr)
        return 2
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if in_main_thread:  # inside the try: a SIGTERM right after this is handled like any other
            interrupts.install()
        with manners.applied(args):  # log level, progress bars, threads (cli/manners.py)
            logging.getLogger(__name__).debug("host allocator: %s", "tuned" if applied else "unchanged")
            rc = int(args.func(args) or 0)
        if in_main_thread and interrupts.requested():  # its exception was swallowed (a finaliser) past every check
            print(f"featcal: terminated (SIGTERM) as the command finished: {finished_message(args)}", file=sys.stderr)
            return 130
        return rc
    except FeatCalError as exc:
        print(f"featcal: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the environment (a file vanished, permissions): one line, not a traceback
        print(f"featcal: error: {one_line(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:
        cause = os_error_of(exc)  # an OSError a library wrapped in its own exception (safetensors on ENOSPC)
        if cause is None:
            raise
        print(f"featcal: error: {cause.strerror or cause} ({one_line(exc)})", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(interrupted_message(args, exc), file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            interrupts.restore(previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
