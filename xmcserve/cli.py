"""``xmcserve``: the project's command line, one command per job.

Each command is the module that does the job (``xmcserve build`` is ``python -m export.build``,
with the same options, output and exit codes); the modules are imported only when their command
runs, so ``xmcserve serve`` and ``xmcserve predict`` never import torch. ``xmcserve COMMAND
--help`` describes each."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    module: str  # whose main(argv) runs it
    summary: str


COMMANDS = {
    "convert": Command("xmc.convert", "your labelled texts (CSV, TSV, JSON lines, Parquet, datasets) to a data folder"),
    "fit": Command("export.fit", "train, build, fuse and evaluate a bundle from a data folder, in one go"),
    "build": Command("export.build", "a bundle from a data folder and an encoder checkpoint (no training)"),
    "fuse": Command("export.fuse", "fit a bundle's score fusion and sparse ranker on its held-out instances"),
    "evaluate": Command("export.evaluate", "a bundle's quality on a split (P@k, PSP@k, R@k), as JSON"),
    "train": Command("training.train", "fine-tune the encoder (UniDEC) on a data folder (needs the train extra)"),
    "predict": Command("xmcserve.cli", "the k best labels of texts, from a bundle, without a server"),
    "serve": Command("service.http.server", "the HTTP server over a bundle (POST /predict)"),
    "compact": Command("export.compact", "fold a bundle's appended instances into a new bundle"),
    "reindex": Command("export.reindex", "rebuild a bundle's key index with other parameters"),
    "info": Command("xmcserve.cli", "what a bundle holds, how it was made and how good it is"),
}


def top_parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in COMMANDS)
    listing = "\n".join(f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="xmcserve",
        description="Extreme multi-label classification: the k most relevant labels of a short text.",
        epilog=f"commands:\n{listing}\n\n`xmcserve COMMAND --help` describes each.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.usage = "xmcserve [--version] COMMAND [OPTIONS]"
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}", help="print the version")
    return parser


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("xmcserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def predict_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xmcserve predict",
        description="The k best labels of each text from a bundle, in process: one JSON line per text "
        "(its labels' uid, text and score, best first). Texts come as arguments, or one a line on "
        "standard input when none is given.",
    )
    parser.add_argument("--bundle", type=Path, required=True, help="the bundle folder")
    parser.add_argument("-k", "--k", type=int, default=10, help="labels per text (default 10)")
    parser.add_argument("--exclude", action="append", default=[], metavar="UID", help="a label uid never to return")
    parser.add_argument("--threads", type=int, default=None, help="encoder threads (default: one a core)")
    parser.add_argument("texts", nargs="*", help="the texts (default: standard input, one a line)")
    return parser


def predict(argv: list[str]) -> int:
    from xmcserve.model import load

    args = predict_parser().parse_args(argv)
    if args.k < 1:
        raise SystemExit("xmcserve predict: -k must be at least 1")
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise SystemExit("xmcserve predict: no texts (give them as arguments or on standard input)")
    model = load_or_exit(load, args.bundle, args.threads)
    for text, labels in zip(texts, model.predict(texts, args.k, set(args.exclude)), strict=True):
        print(json.dumps({"text": text, "labels": [vars(label) for label in labels]}, ensure_ascii=False))
    return 0


def load_or_exit(load, *args):
    from bundle import BundleError

    try:
        return load(*args)
    except (BundleError, FileNotFoundError) as exc:
        raise SystemExit(f"xmcserve: {exc}") from None


def info_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xmcserve info",
        description="What a bundle holds, how it was made and how good it is: its card (data, recipe, "
        "training time, measured figures and baselines) and its manifest (kind, labels, keys, encoder, "
        "fusion, files), as JSON; the files' checksums are checked first.",
    )
    parser.add_argument("bundle", type=Path, help="the bundle folder")
    parser.add_argument("--no-verify", action="store_true", help="skip the files' checksums (faster on large bundles)")
    return parser


def info(argv: list[str]) -> int:
    from bundle import BundleError, read_card, read_manifest, verify_checksums

    args = info_parser().parse_args(argv)
    try:
        manifest = read_manifest(args.bundle)
        if not args.no_verify:
            verify_checksums(args.bundle, manifest)  # every file the manifest lists
        card = read_card(args.bundle, manifest.files)
    except (BundleError, FileNotFoundError) as exc:
        raise SystemExit(f"xmcserve info: {exc}") from None
    shown = {"card": card.model_dump(mode="json") if card else None, "manifest": manifest.model_dump(mode="json")}
    print(json.dumps(shown, indent=2, ensure_ascii=False))
    return 0


OWN = {"predict": predict, "info": info}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = top_parser()
    if not argv or argv[0].startswith("-"):  # --help, --version, or a mistake argparse words
        parser.parse_args(argv)
        parser.error("a command is needed")
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r} (choose from {', '.join(COMMANDS)})")
    if name in OWN:
        return OWN[name](rest)
    module = importlib.import_module(COMMANDS[name].module)
    saved, sys.argv[0] = sys.argv[0], f"xmcserve {name}"  # each module's --help names the command
    try:
        return module.main(rest) or 0
    finally:
        sys.argv[0] = saved


if __name__ == "__main__":
    sys.exit(main())
