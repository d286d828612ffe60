"""xmcserve in process, and the ``xmcserve`` command (:mod:`xmcserve.cli`).

    import xmcserve
    model = xmcserve.load("bundles/default")
    model.predict(["a terminal emulator"], k=5)   # [[Label(uid, text, score), ...]]

:func:`load` and :class:`Model` are torch-free, like the server. :func:`fit`, :func:`build` and
:func:`convert` make bundles and data folders, as ``xmcserve fit``, ``build`` and ``convert``
do; they need the train extra (torch), imported only when called. The library raises; the
command line turns errors into exit codes."""

from __future__ import annotations

from pathlib import Path

from xmcserve.model import Label, Model, load

__all__ = ["Label", "Model", "load", "fit", "build", "convert"]


def fit(
    data: Path | str,
    bundle: Path | str,
    run: Path | str | None = None,
    force: bool = False,
    recipe: str = "debian-unidec",
    **overrides,
) -> dict:
    """Train, build, fuse and evaluate a bundle from a data folder (``xmcserve fit``): the fit's
    summary (paths, timings, the held-out figures). ``overrides``: training parameters
    (``epochs=3`` as ``--set epochs=3``); ``run``: the training run folder (default
    ``runs/<bundle name>``); ``recipe``: a shipped recipe's name or a YAML file."""
    from export.fit import fit as fit_bundle

    bundle = Path(bundle)
    settings = [f"{key}={value}" for key, value in overrides.items()]
    run_dir = Path(run) if run else Path("runs") / bundle.name
    return fit_bundle(Path(data), bundle, run_dir, force, settings, str(recipe))


def build(data: Path | str, bundle: Path | str, checkpoint: Path | str | None = None, **params) -> Path:
    """A bundle from a data folder's labels and training split with an encoder checkpoint
    (default: the pretrained all-MiniLM-L6-v2), without training (``xmcserve build``).
    ``params``: :class:`export.build.ExportParams` fields (``index_kind="labels"``, ``dim=64``…)."""
    from export.build import ExportParams, build_bundle
    from xmc.checkpoint import default_encoder_dir
    from xmc.data import load_jsonl_split

    train = load_jsonl_split(Path(data), "trn")
    out = Path(bundle)
    build_bundle(
        out, train.labels, train, Path(checkpoint) if checkpoint else default_encoder_dir(), ExportParams(**params)
    )
    return out


def convert(splits: dict[str, Path | str], out: Path | str, labels: Path | str | None = None, **params):
    """Labelled texts as a data folder ``xmcserve fit`` reads (``xmcserve convert``): ``splits``
    maps a split name (``trn``, ``dev``, ``tst``) to its file; returns the
    :class:`xmc.convert.Summary`. A refusal raises :class:`xmc.convert.ConversionRefused`
    listing each problem with its file and row, and nothing is written. ``params``:
    :class:`xmc.convert.ConvertParams` fields (``text_column="title"``, ``dev_share=0.1``…)."""
    from xmc.convert import ConvertParams
    from xmc.convert import convert as convert_splits

    named = {name: Path(path) for name, path in splits.items()}
    return convert_splits(ConvertParams(splits=named, out=Path(out), labels=Path(labels) if labels else None, **params))
