"""``python -m studies.non_encoder_cost``: runs :func:`studies.non_encoder_cost.run.main`."""

from studies.non_encoder_cost.run import main

if __name__ == "__main__":
    raise SystemExit(main())
