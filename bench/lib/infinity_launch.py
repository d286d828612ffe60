"""infinity-emb's command line with a fixed number of ONNX Runtime intra-op threads.

    .venv-infinity/bin/python -I bench/lib/infinity_launch.py THREADS v2 --model-id DIR ...

infinity's optimum engine opens its session without session options, so ONNX Runtime would
choose the thread count itself (its count of physical cores, which need not be the cores the
process is pinned to). Here every session is opened with ``THREADS`` intra-op threads unless its
options name a count, then infinity's own ``infinity_emb`` command runs with the other arguments.

Run by the peer's virtualenv with ``-I`` (``bench.lib.infinity_peer``): nothing of xmcserve is
importable there, and nothing of it is imported here.
"""

import sys


def with_threads(threads: int) -> None:
    """Give every ``onnxruntime.InferenceSession`` opened from now on ``threads`` intra-op threads."""
    import onnxruntime as ort

    opened = ort.InferenceSession.__init__

    def init(self, path_or_bytes, sess_options=None, *args, **kwargs):
        options = sess_options if sess_options is not None else ort.SessionOptions()
        if options.intra_op_num_threads == 0:
            options.intra_op_num_threads = threads
        opened(self, path_or_bytes, options, *args, **kwargs)

    ort.InferenceSession.__init__ = init


def main() -> None:
    threads, args = int(sys.argv[1]), sys.argv[2:]
    with_threads(threads)
    from infinity_emb.cli import cli

    sys.argv = ["infinity_emb", *args]
    cli()


if __name__ == "__main__":
    main()
