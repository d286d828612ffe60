"""``python -m studies.ddp_parity``: runs :func:`studies.ddp_parity.run.main`."""

from studies.ddp_parity.run import main

if __name__ == "__main__":
    raise SystemExit(main())
