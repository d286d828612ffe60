"""``python -m tools.gpu``: runs :func:`tools.gpu.run.main`."""

from tools.gpu.run import main

if __name__ == "__main__":
    raise SystemExit(main())
