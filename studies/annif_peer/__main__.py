"""``python -m studies.annif_peer``: runs :func:`studies.annif_peer.run.main`."""

from studies.annif_peer.run import main

if __name__ == "__main__":
    raise SystemExit(main())
