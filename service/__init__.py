"""xmcserve serving: torch-free FastAPI service over an immutable bundle (ONNX encoder + HNSW index)."""
