"""Shipping a new bundle: A/B variants with sticky routing and atomic swaps, mirroring to a
remote shadow with comparisons, and the report over the comparison log.

The variant names live here, not in :mod:`~service.rollout.variants`, so the shadow worker's
child process can name them without importing the engine.
"""

PRIMARY = "A"
CANDIDATE = "B"
