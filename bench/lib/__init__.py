"""What the benchmarks share, apart from the benchmarks themselves (``python -m bench.<name>``):

* :mod:`bench.lib.loadgen` — closed- and open-loop HTTP load with latency percentiles;
* :mod:`bench.lib.recall` — exact search over a bundle's keys, the reference of recall@k;
* :mod:`bench.lib.latency` — one request at a time against an idle server, and its stage medians;
* :mod:`bench.lib.profiling` — a server process's CPU seconds and its py-spy profile, folded by stage;
* :mod:`bench.lib.thread_cpu` — a server's CPU by thread from ``/proc``, each thread named by its Python thread;
* :mod:`bench.lib.non_encoder` — the null-encoder measurement (``bench.non_encoder_cost``, ``bench.serving``);
* :mod:`bench.lib.encoder_alone` — the ONNX encoder timed on its own;
* :mod:`bench.lib.synthetic` — clustered synthetic vectors and their exact neighbours;
* :mod:`bench.lib.held_out` — a fused bundle's held-out instances and their features;
* :mod:`bench.lib.naive_server`, :mod:`bench.lib.null_encoder` — the servers compared with xmcserve's;
* :mod:`bench.lib.floors` — a bare ASGI app and a bare FastAPI route under our server's uvicorn settings;
* :mod:`bench.lib.otlp_receiver` — an OTLP/HTTP trace receiver; :mod:`bench.lib.browser` — headless Chromium.

A local server over a bundle is started with :mod:`loadtest.localserver` (the load test uses it too).
"""
