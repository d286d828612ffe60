"""A group's /metrics view (prometheus-client's multiprocess files), in a process of its own since
the client reads its mode when first imported: counters summed over every worker that counted,
live gauges over the live workers only, a killed worker's gauges forgotten by the next to start."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, os, shutil, sys
    from pathlib import Path
    from service.http.metrics import Metrics

    directory = Path(sys.argv[1])
    metrics = Metrics(directory)
    metrics.in_flight.inc(3)
    metrics.predicted_texts.labels(variant="A").inc(5)
    # a worker killed with 2 requests in flight and 7 texts answered: its files, under a dead pid
    dead = 2**22 + 12345
    for file in directory.glob(f"*_{os.getpid()}.db"):
        shutil.copy(file, file.with_name(file.name.replace(str(os.getpid()), str(dead))))

    def figures():
        text = metrics.exposition().decode()
        pick = lambda name: float(next(l for l in text.splitlines() if l.startswith(name)).split()[-1])
        return pick("xmcserve_in_flight_requests "), pick('xmcserve_predicted_texts_total{variant="A"}')

    before = figures()
    forgotten = metrics.forget_dead(lambda pid: pid != dead)
    print(json.dumps({"before": before, "after": figures(), "forgotten": forgotten, "dead": dead}))
    """
)


def test_counters_sum_every_worker_and_live_gauges_forget_a_killed_one(tmp_path):
    directory = tmp_path / "metrics"
    directory.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(directory)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["before"] == [6.0, 10.0]  # both workers' in-flight requests and texts
    assert result["forgotten"] == [result["dead"]]
    assert result["after"] == [3.0, 10.0]  # the dead one's gauge gone, its count kept
