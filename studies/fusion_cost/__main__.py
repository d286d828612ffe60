"""``python -m studies.fusion_cost``: runs :func:`studies.fusion_cost.run.main`."""

from studies.fusion_cost.run import main

if __name__ == "__main__":
    raise SystemExit(main())
