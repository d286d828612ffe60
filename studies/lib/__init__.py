"""What several studies share (no study imports another)."""
