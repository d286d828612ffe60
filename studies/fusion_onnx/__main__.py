"""``python -m studies.fusion_onnx``: runs :func:`studies.fusion_onnx.run.main`."""

from studies.fusion_onnx.run import main

if __name__ == "__main__":
    raise SystemExit(main())
