"""`featcal supported`: which models featcal calibrates, checked from their configs (no weights read).

Without arguments it lists the model types the test suite calibrates end to end; with model types or
checkpoint directories it checks those, as `featcal calibrate` would before loading anything. `--markdown`
prints docs/supported.md. Everything it prints comes from blocks/support.py and blocks/catalog.py.

Start-up: a folder without a config.json and a name transformers has no model type for are refused without
importing torch; any other answer imports it, because transformers 5's config classes do wherever torch is
installed and because the structure is read from the model built on the meta device (blocks/support.py).
"""

from __future__ import annotations

import argparse

from featcal.cli.commands import HELP


def run(args: argparse.Namespace) -> int:
    from featcal.blocks import catalog

    if args.markdown:
        print(catalog.markdown(), end="")
        return 0
    names = args.models or list(catalog.VERIFIED)
    verdicts = [catalog.verdict(n) for n in names]
    print(catalog.render_text(verdicts))
    if not args.models:
        print("\n(these model types are calibrated end to end by the test suite; any other block-stacked "
              "transformers model is checked the same way: featcal supported MODEL_TYPE_OR_CHECKPOINT)")
    return 0 if all(v["supported"] for v in verdicts) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "supported", help=HELP["supported"],
        description="Check whether featcal can calibrate a model, from its config alone, and show what would be "
        "calibrated (the stacks of blocks, the Linear / Conv1D layers and norms in each block) and what keeps "
        "its merged value. Without arguments: the model types the test suite calibrates end to end. Exit "
        "status 1 when a model given is not supported.",
    )
    p.add_argument("models", nargs="*", metavar="MODEL_TYPE_OR_CHECKPOINT",
                   help="transformers model types (llama, gpt2, ...) or checkpoint directories with a config.json")
    p.add_argument("--markdown", action="store_true", help="print docs/supported.md (the verified list, refusals)")
    p.set_defaults(func=run)
