"""``python -m studies.ann_compressed``: runs :func:`studies.ann_compressed.run.main`."""

from studies.ann_compressed.run import main

if __name__ == "__main__":
    raise SystemExit(main())
