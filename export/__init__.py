"""xmcserve export: checkpoint dir -> serving bundle (ONNX encoder, key index, labels, manifest)."""
