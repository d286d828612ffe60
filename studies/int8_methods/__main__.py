"""``python -m studies.int8_methods``: runs :func:`studies.int8_methods.run.main`."""

from studies.int8_methods.run import main

if __name__ == "__main__":
    raise SystemExit(main())
