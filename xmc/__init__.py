"""The torch-free XMC core every stage shares: training, export, service and bench import it, and it
imports none of them.

* :mod:`xmc.data` — the Extreme Classification Repository layouts, read into one
  :class:`~xmc.data.XMCDataset` (texts, sparse relevance, the label space, filter pairs);
* :mod:`xmc.convert` — users' own CSV, Parquet or JSONL into that layout, validated;
* :mod:`xmc.metrics` — P@k, nDCG@k, PSP@k, R@k, macro-F1@k, and the "filter after ranking" protocol;
* :mod:`xmc.evaluate` — a predictor ranked over a split under both filter protocols;
* :mod:`xmc.checkpoint` — the checkpoint and run-directory files training writes and export reads;
* :mod:`xmc.options` — value parsers the stages' command lines share;
* :mod:`xmc.results` — the one writer of result files (``bench/results/``, ``export.evaluate --out``),
  their paths named relative to the repository.
"""
