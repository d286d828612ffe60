"""xmcserve serving: torch-free FastAPI service over an immutable bundle (ONNX encoder + key index:
hnswlib, IVF-PQ or sharded)."""
