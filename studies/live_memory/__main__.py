"""``python -m studies.live_memory``: runs :func:`studies.live_memory.run.main`."""

from studies.live_memory.run import main

if __name__ == "__main__":
    raise SystemExit(main())
