"""``python -m studies.batch_invariance``: runs :func:`studies.batch_invariance.run.main`."""

from studies.batch_invariance.run import main

if __name__ == "__main__":
    raise SystemExit(main())
