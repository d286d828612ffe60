"""xmcserve export: checkpoint dir -> serving bundle (ONNX encoder, HNSW index, labels, manifest)."""
