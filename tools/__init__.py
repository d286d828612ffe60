"""Tools of the lab that are neither a benchmark nor a study: the GPU device payload and its run
(``tools/gpu/``), the docs' screenshots of the rollout page (:mod:`tools.rollout_screenshots`)."""
