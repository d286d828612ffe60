"""``python -m studies.quality``: runs :func:`studies.quality.run.main`."""

from studies.quality.run import main

if __name__ == "__main__":
    raise SystemExit(main())
