"""Studies: one question each, asked once or now and then (quality, the peers, a method's choice),
one folder a study with its README.md and its command, ``python -m studies.<name>``. The speed and
scale benchmarks are in bench/, the GPU payload and the docs' screenshots in tools/."""
