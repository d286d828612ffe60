"""``python -m studies.candidate_sources``: runs :func:`studies.candidate_sources.run.main`."""

from studies.candidate_sources.run import main

if __name__ == "__main__":
    raise SystemExit(main())
