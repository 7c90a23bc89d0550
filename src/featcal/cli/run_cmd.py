"""`featcal run FILE.yaml`: a whole merge (and optional calibration) described by one YAML file.

The run file's format and what a run does: featcal/jobs/run_job.py (`featcal.run`, featcal.jobs.run_file), which
this command calls with the file and its flags.
"""

from __future__ import annotations

import argparse

from featcal.cli.commands import HELP
from featcal.jobs.run_job import execute, load, resolve_paths  # noqa: F401  (their import path before issue 52)


def run_file(args: argparse.Namespace) -> int:
    from featcal import jobs

    result = jobs.run_file(jobs.RunRequest(args.file, out=args.out, progress=not args.no_progress))
    if result.calibrated:
        from featcal.cli.calibrate_cmd import print_data_lines

        print_data_lines(result.report)
    print(result.summary())
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help=HELP["run"],
        description="Run a merge, and a FeatCal calibration when the file has a `calibrate:` section, "
        "from one YAML file validated by the same schema as the CLI flags. Relative paths are relative "
        "to the file's directory.",
    )
    p.add_argument("file", metavar="FILE.yaml", help="the run file: featcal's, or a mergekit configuration "
                   "(merge_method, base_model, models, ...; docs/mergekit.md)")
    p.add_argument("--out", default=None, help="the output directory, where the file names none (a mergekit "
                   "configuration has no out:)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_file)
