"""``python -m studies.peers``: runs :func:`studies.peers.run.main`."""

from studies.peers.run import main

if __name__ == "__main__":
    raise SystemExit(main())
