"""``python -m studies.sparse_dense_ranker``: runs :func:`studies.sparse_dense_ranker.run.main`."""

from studies.sparse_dense_ranker.run import main

if __name__ == "__main__":
    raise SystemExit(main())
