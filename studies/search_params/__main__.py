"""``python -m studies.search_params``: runs :func:`studies.search_params.run.main`."""

from studies.search_params.run import main

if __name__ == "__main__":
    raise SystemExit(main())
