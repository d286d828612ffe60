"""Serving on a lent CUDA machine in one prepared run (:mod:`tools.gpu.run`, ``make bench-gpu``) and the
files and device calls that carry it there (:mod:`tools.gpu.payload`)."""
