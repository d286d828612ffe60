"""Shipping a new bundle: mirroring to a remote shadow with comparisons, the agreement the rollout
page plots, and the report over the comparison log (the A/B variants themselves, their sticky
routing and atomic swaps, are the engine's: :mod:`engine.variants`).

The variant names live here: the engine's variants (:mod:`engine.variants`) are named by the
front end that builds them, and the shadow worker's child process names them without importing
the engine.
"""

PRIMARY = "A"
CANDIDATE = "B"
