"""``python -m studies.fusion_shift``: runs :func:`studies.fusion_shift.run.main`."""

from studies.fusion_shift.run import main

if __name__ == "__main__":
    raise SystemExit(main())
