"""bench.app_cpu drives /predict through the app with the null encoder (XMCSERVE_ENCODER=null)
and records every level, and leaves the process's environment, encoders and logging as it found
them (later tests encode for real)."""

import json
import logging
import os

from bench.app_cpu import main
from engine.offline import OnnxEncoder


def test_every_concurrency_level_is_answered_and_recorded(sample_bundle, sample_dir, tmp_path):
    out = tmp_path / "app-cpu.json"
    real_run = OnnxEncoder.run
    main(
        ["--bundle", str(sample_bundle), "--data", str(sample_dir), "--requests", "40", "--concurrency", "1", "3"]
        + ["--out", str(out)]
    )
    levels = json.loads(out.read_text())["by_concurrency"]
    assert set(levels) == {"1", "3"} and all(level["cpu_us_per_request"] > 0 for level in levels.values())
    assert OnnxEncoder.run is real_run and not logging.root.manager.disable
    assert "XMCSERVE_ENCODER" not in os.environ and "XMCSERVE_NULL_VECTORS" not in os.environ
