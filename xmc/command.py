"""How a command names itself in its ``--help`` and errors: ``xmcserve build`` when the
``xmcserve`` command runs it (:mod:`xmcserve.cli` sets ``sys.argv[0]`` so), else ``python -m
export.build``, the way it was started."""

import sys


def program(module: str) -> str:
    """The name to give argparse's ``prog`` for the command module ``module``."""
    started_as = sys.argv[0] if sys.argv else ""
    return started_as if started_as.startswith("xmcserve ") else f"python -m {module}"
