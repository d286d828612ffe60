"""``python -m studies.fusion_models``: runs :func:`studies.fusion_models.run.main`."""

from studies.fusion_models.run import main

if __name__ == "__main__":
    raise SystemExit(main())
