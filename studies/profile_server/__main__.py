"""``python -m studies.profile_server``: runs :func:`studies.profile_server.run.main`."""

from studies.profile_server.run import main

if __name__ == "__main__":
    raise SystemExit(main())
