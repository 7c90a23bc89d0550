"""The flags every `featcal` command takes, before or after its name, and what they set for the run.

    featcal [--version] [-q | -v | --log-level LEVEL] [--no-progress] [--threads N] COMMAND ...

They are added to the top-level parser and to every sub-command's parser (nested ones too), so
`featcal --quiet merge ...` and `featcal merge ... --quiet` mean the same; on a sub-command their
default is left unset, so a flag given before the command name is not reset by the sub-command's
parser. A sub-command that defined one of them already (bench's --threads, merge's --no-progress)
keeps its own help; only its default is handed to the top-level parser.

`applied(args)` sets, for the duration of the command: the log level and one stderr handler (each
warning shown once; see ShownOnce), Python warnings routed through it, every library's progress bars
off with --no-progress or --quiet (transformers', huggingface_hub's, datasets'), and torch's threads.
Everything but the thread count is restored afterwards, for callers that run several commands in
one process (tests).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import numbers
import os
import sys
from collections.abc import Iterator

from featcal.errors import ConfigError

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
# the libraries whose own progress bars --no-progress turns off, and their environment switch (read at import)
_DATASETS_BARS_ENV = "HF_DATASETS_DISABLE_PROGRESS_BARS"
# commands that run the experiment apparatus: their packages come with an extra (featcal/io/process/extras.py)
COMMAND_EXTRAS = {("bench",): "bench", ("reproduce",): "bench", ("zoo", "build"): "bench"}


def version() -> str:
    from featcal import __version__

    return __version__


def _flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """The global flags on one parser; below the top one they default to unset (argparse.SUPPRESS)."""
    unset = {} if top else {"default": argparse.SUPPRESS}
    specs = [
        (("-q", "--quiet"), dict(action="store_true", help="only warnings and errors on stderr (no progress bars, no "
                                 "INFO lines)")),
        (("-v", "--verbose"), dict(action="store_true", help="debug logging (shows every repeated warning)")),
        (("--log-level",), dict(choices=list(LOG_LEVELS), default=None, metavar="LEVEL",
                                help="stderr log level: debug, info (default), warning or error")),
        (("--no-progress",), dict(action="store_true", help="no progress bars, featcal's or any library's")),
        (("--threads",), dict(type=int, default=0, metavar="N", help="torch CPU threads (0: torch's default)")),
    ]
    group = None
    for names, kwargs in specs:
        dest = names[-1].lstrip("-").replace("-", "_")
        existing = [parser._option_string_actions.get(n) for n in names]
        if any(existing):
            action = next(a for a in existing if a is not None)
            if action.dest != dest:
                raise RuntimeError(f"{parser.prog}: {names[-1]} is taken by dest {action.dest!r}")  # a coding error
            if not top:
                action.default = argparse.SUPPRESS
            continue
        if group is None:
            group = parser.add_argument_group("global options (also accepted before the command)")
        group.add_argument(*names, dest=dest, **{**kwargs, **unset})


def _sub_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to one parser
                yield sub
                yield from _sub_parsers(sub)


def add_global_flags(parser: argparse.ArgumentParser) -> None:
    """--version on `parser`; the other global flags on it and on every sub-command's parser."""
    parser.add_argument("--version", action="version", version=f"featcal {version()}")
    _flags(parser, top=True)
    for sub in _sub_parsers(parser):
        _flags(sub, top=False)


def log_level(args: argparse.Namespace) -> int:
    """The one log level --quiet, --verbose and --log-level ask for; two of them at once are refused."""
    given = [flag for flag, on in (("--quiet", args.quiet), ("--verbose", args.verbose),
                                   ("--log-level", args.log_level is not None)) if on]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} both set the log level: give one")
    if args.quiet:
        return logging.WARNING
    if args.verbose:
        return logging.DEBUG
    return LOG_LEVELS[args.log_level or "info"]


def command_extra(args: argparse.Namespace) -> str | None:
    """The extra whose packages the chosen command needs, if any."""
    path = tuple(v for v in (getattr(args, "command", None), getattr(args, "zoo_command", None)) if v)
    return next((extra for cmd, extra in COMMAND_EXTRAS.items() if path[:len(cmd)] == cmd), None)


class ShownOnce(logging.Filter):
    """Each warning once: a record repeating an earlier one's message with other figures (floats) is counted,
    not shown. Such repeats come from the same check run again on another fit (each --tune candidate, each
    cross-fitting fold); what they name (a task, a block, a path) is kept in the comparison, so a warning about
    another task still shows. Below WARNING nothing is held back."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple] = set()
        self.repeats = 0

    @staticmethod
    def key(record: logging.LogRecord) -> tuple:
        args = record.args if isinstance(record.args, tuple) else (record.args,) if record.args else ()
        named = tuple(repr(a) for a in args if not (isinstance(a, numbers.Real) and not isinstance(a, numbers.Integral)))
        return record.name, record.levelno, str(record.msg), named

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = self.key(record)
        if key in self.seen:
            self.repeats += 1
            return False
        self.seen.add(key)
        return True


class NotShownElsewhere(logging.Filter):
    """Drop a record a library already printed with its own stderr handler on the way up to the root logger.

    huggingface_hub and datasets give their loggers a StreamHandler and leave them propagating (transformers
    too where CI is set), so each of their warnings printed twice: once by theirs, once by ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        root = logging.getLogger()
        while logger is not None and logger is not root:
            for h in logger.handlers:
                if (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                        and record.levelno >= h.level):
                    return False
            if not logger.propagate:
                break
            logger = logger.parent
        return True


@contextlib.contextmanager
def _logging(level: int) -> Iterator[ShownOnce]:
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    once = ShownOnce()
    handler.addFilter(NotShownElsewhere())
    if level > logging.DEBUG:  # --verbose shows every repeat
        handler.addFilter(once)
    previous = root.level
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # Python warnings through the same handler, level and once-only rule
    try:
        yield once
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        root.setLevel(previous)
        if once.repeats and level <= logging.WARNING:
            print(f"featcal: {once.repeats} repeat(s) of the warnings above, with other figures, not shown "
                  "(--verbose shows each)", file=sys.stderr)


@contextlib.contextmanager
def _no_library_bars() -> Iterator[None]:
    """transformers', huggingface_hub's and datasets' progress bars off (featcal's own follow `progress`)."""
    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    hub_was_on = not hub.are_progress_bars_disabled()
    hf_was_on = hf_logging.is_progress_bar_enabled()
    env_was = os.environ.get(_DATASETS_BARS_ENV)
    hub.disable_progress_bars()
    hf_logging.disable_progress_bar()
    if env_was is None:
        os.environ[_DATASETS_BARS_ENV] = "1"  # read when datasets is imported
    datasets_tqdm = sys.modules.get("datasets.utils.tqdm")
    datasets_was_on = datasets_tqdm is not None and not datasets_tqdm.are_progress_bars_disabled()
    if datasets_was_on:
        datasets_tqdm.disable_progress_bars()
    try:
        yield
    finally:
        if hub_was_on:
            hub.enable_progress_bars()
        if hf_was_on:
            hf_logging.enable_progress_bar()
        if env_was is None:
            os.environ.pop(_DATASETS_BARS_ENV, None)
        if datasets_was_on:
            datasets_tqdm.enable_progress_bars()


@contextlib.contextmanager
def applied(args: argparse.Namespace) -> Iterator[None]:
    """The global flags in force while the command runs (ConfigError on a bad combination, before any work)."""
    from featcal.io.process.extras import require

    level = log_level(args)
    if args.quiet:
        args.no_progress = True  # stderr holds warnings and errors only
    extra = command_extra(args)
    if extra:
        require(extra, f"featcal {' '.join(v for v in (args.command, getattr(args, 'zoo_command', None)) if v)}")
    if args.threads:  # its module builds calibrate's flags (pydantic's schemas): imported where it has work
        from featcal.cli.calibrate_args import apply_threads

        apply_threads(args.threads)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_logging(level))
        if args.no_progress:
            stack.enter_context(_no_library_bars())
        yield
