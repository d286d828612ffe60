"""The harness the benchmarks share (``python -m bench.<name>``; studies and tools use it too):
``args`` (one parent parser of the options they repeat: ``--bundle``, ``--data``, ``--out``...),
``latency`` (an idle server one request at a time),
``profiling`` and ``thread_cpu`` (a server's CPU and memory by process and thread, its py-spy
profile), ``non_encoder`` (the null-encoder measurement), ``encoder_alone``, ``synthetic``,
``synthetic_bundle`` and ``stages`` (synthetic vectors and bundles, end-to-end stages), the servers
set beside ours (``naive_server``, ``null_encoder``, ``floors``, the peer's ``infinity_peer`` and
``infinity_launch``) and ``otlp_receiver`` (a trace sink). A server over a bundle is started by
:mod:`loadtest.localserver` and loaded by :mod:`loadtest.loadgen` (closed- and open-loop HTTP
load), beside the load test's locust scenarios; a result file is written by
:func:`xmc.results.write_result`, naming the machine of :func:`xmc.results.machine`."""
