"""Build the project's images with whichever container tool is there (deploy/checks/runtime.py),
tagged ``xmcserve-<flavour>:<pyproject version>``; print and record each image's build seconds
and size.

    python3 deploy/checks/build_images.py [--only serve,train] [--stand-ins] [--no-layer-cache] [--out results.json]

Build arguments come from the environment: any ``ARG`` a Dockerfile declares (PYTHON_IMAGE,
TORCH_INDEX_URL, CUDA_IMAGE, RAY_IMAGE, ...) that is set, even to an empty value, is passed.
``--stand-ins`` builds the two images whose bases cannot be had everywhere (NVIDIA's CUDA image,
Ray's image) on local stand-ins: Debian bookworm for CUDA (same apt Python layers, no CUDA), and
python:3.11-slim with Ray's user and the pinned ray[serve] for Ray; their Python layers are what
gets checked. ``--no-layer-cache`` keeps no intermediate layers (podman/buildah on vfs storage,
where each layer is a full copy of the filesystem: the train image's would fill a small disk).

torch: Dockerfile.train installs it from TORCH_INDEX_URL (PyTorch's CPU index by default). Where
that index cannot be reached but pip's own configuration has the wheel (a local wheel directory,
a mirror), build with ``TORCH_INDEX_URL=`` (set and empty): torch then comes from pip's indexes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from runtime import ROOT, Runtime, image_name

IMAGES = {  # flavour -> Dockerfile; the order builds the serving image first
    "serve": "deploy/Dockerfile",
    "loadtest": "deploy/Dockerfile.loadtest",
    "train": "deploy/Dockerfile.train",
    "serve-gpu": "deploy/Dockerfile.gpu",
    "ray": "deploy/Dockerfile.ray",
}
STANDIN_DIR = ROOT / "deploy/checks/standins"
STANDINS = {"CUDA_IMAGE": "debian:bookworm-slim", "RAY_IMAGE": "xmcserve-standin-ray:local"}


def declared_args(dockerfile: str) -> list[str]:
    return re.findall(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)", (ROOT / dockerfile).read_text(), re.M)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", default=",".join(IMAGES), help=f"comma-separated flavours to build, of {', '.join(IMAGES)}"
    )
    parser.add_argument(
        "--stand-ins", action="store_true", help="build the CUDA and Ray images on local stand-in bases"
    )
    parser.add_argument(
        "--no-layer-cache",
        action="store_true",
        help="keep no intermediate layers (podman/buildah --layers=false): saves disk on vfs storage",
    )
    parser.add_argument("--out", type=Path, default=None, help="merge the figures into this JSON file")
    parser.add_argument("--logs", type=Path, default=ROOT / "build/image-logs", help="directory for the build logs")
    args = parser.parse_args(argv)
    wanted = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = set(wanted) - set(IMAGES)
    if unknown:
        parser.error(f"unknown flavours: {', '.join(sorted(unknown))}")
    runtime = Runtime.detect()
    args.logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.stand_ins:
        for key, value in STANDINS.items():
            env.setdefault(key, value)
        if "ray" in wanted and env["RAY_IMAGE"] == STANDINS["RAY_IMAGE"]:
            runtime.build(
                str((STANDIN_DIR / "ray.Containerfile").relative_to(ROOT)),
                STANDINS["RAY_IMAGE"],
                log=args.logs / "standin-ray.log",
                keep_layers=not args.no_layer_cache,
            )
    figures = {}
    for flavour in wanted:
        dockerfile, tag = IMAGES[flavour], image_name(flavour)
        build_args = {name: env[name] for name in declared_args(dockerfile) if name in env}
        print(f"building {tag} from {dockerfile} {build_args or ''} ...", flush=True)
        started = time.time()
        seconds = runtime.build(
            dockerfile, tag, build_args, log=args.logs / f"{flavour}.log", keep_layers=not args.no_layer_cache
        )
        size = runtime.image_bytes(tag) if runtime.cli_prefix else None
        figures[tag] = {
            "dockerfile": dockerfile,
            "build_args": build_args,
            "layer_cache": not args.no_layer_cache,
            "build_seconds": seconds["tagged"],
            "build_seconds_with_cleanup": seconds["total"],
            "size_mb": round(size / 1e6, 1) if size else None,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        }
        print(f"{tag}: {seconds['tagged']:.0f} s to the image, {figures[tag]['size_mb']} MB", flush=True)
        if args.out:  # after each image: a later build that fails leaves the earlier figures
            record = json.loads(args.out.read_text()) if args.out.exists() else {}
            record.setdefault("images", {}).update(figures)
            record["runtime"] = runtime.name
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
