"""Helpers only the tests use (the shared fixtures are in tests/conftest.py). What the benchmarks
and studies run too is product code (the references in :mod:`engine.offline`, say): nothing under
bench/, studies/ or tools/ imports from here, but the screenshot tool, which drives the rollout
page with the page tests' browser (:mod:`tests.support.browser`)."""
