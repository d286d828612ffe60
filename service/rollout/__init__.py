"""Shipping a new bundle: A/B variants with sticky routing and atomic swaps, mirroring to a
remote shadow with comparisons, and the report over the comparison log."""
