"""A study (README.md: what it asks, its command, its result, what it found)."""
