"""``python -m studies.label_keys``: runs :func:`studies.label_keys.run.main`."""

from studies.label_keys.run import main

if __name__ == "__main__":
    raise SystemExit(main())
