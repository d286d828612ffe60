# xmcserve: every set-up step goes through here. A fresh machine needs Python 3.10+ with venv, a
# C++ compiler and the Python headers (README.md, Prerequisites): hnswlib compiles at install.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the project's command (xmcserve/cli.py): every target below that builds, fits, evaluates or serves calls it
XMCSERVE := $(VENV)/bin/xmcserve
# torch is pinned here: this exact version resolves to the local CPU wheel, while an unpinned
# torch pulls several GB of CUDA packages.
TORCH_PIN ?= torch==2.13.0
# Serving and building the default bundle need cpu + train; the dev extra (pytest, Ray, locust,
# schemathesis, kubernetes-validate) only the tests, lint and benchmarks. EXTRAS overrides both.
SERVE_EXTRAS ?= cpu,train
DEV_EXTRAS ?= cpu,train,dev
EXTRAS ?= $(DEV_EXTRAS)
comma := ,
stamp = $(VENV)/.installed-$(subst $(comma),-,$(1))
STAMP := $(call stamp,$(EXTRAS))
SERVE_STAMP := $(if $(filter command line,$(origin EXTRAS)),$(STAMP),$(call stamp,$(SERVE_EXTRAS)))

DATA ?= data/debian-sample
BUNDLE ?= bundles/default
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: prereqs install images image-check compose-check serve serve-ray bundle test lint evaluate sample clean bench-serving bench-ann bench-ab loadtest \
	train train-smoke trained-bundle fit bench-quality bench-quality-fit peers-venv annif-venv infinity-venv bench-infinity bench-ab-own-cores bench-overload bench-ray-scale bench-million \
	bench-ann-compressed bench-ten-million bench-gpu bench-workers

# What a fresh machine lacks, said before pip fails half-way through compiling hnswlib.
PREREQS_HINT := see README.md, Prerequisites (Debian/Ubuntu: apt-get install python3-venv python3-dev g++)
prereqs:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
		|| { echo "xmcserve needs Python 3.10 or newer ($(PYTHON) is older): $(PREREQS_HINT)" >&2; exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null \
		|| { echo "$(PYTHON) has no venv/ensurepip module: $(PREREQS_HINT)" >&2; exit 1; }
	@$(PYTHON) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
		|| { echo "no Python headers (Python.h) for $(PYTHON); hnswlib compiles against them: $(PREREQS_HINT)" >&2; exit 1; }
	@command -v $${CXX:-c++} >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null \
		|| { echo "no C++ compiler (c++, g++ or clang++); hnswlib compiles at install: $(PREREQS_HINT)" >&2; exit 1; }

$(VENV)/.installed-%: pyproject.toml
	@test -x $(PY) || $(MAKE) --no-print-directory prereqs
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_PIN)" -e ".[$(subst -,$(comma),$*)]"
	touch $@

install: $(STAMP)

# The default bundle: sample data, pretrained all-MiniLM-L6-v2, RAE memory, 64-d, dynamic int8
# encoder, which the CPU server runs one text per call like every graph (batch-invariant): P@5
# cost 0.04 points on the full dev split, 1.9x fp32's throughput (bench/results/int8-methods.json;
# int8-static, calibrated, is as accurate as fp32 but no faster here). QUANTIZE=none for fp32.
QUANTIZE ?= int8
$(BUNDLE)/manifest.json: | $(SERVE_STAMP)
	$(XMCSERVE) build --data $(DATA) --out $(BUNDLE) --index-kind rae_memory --dim 64 --quantize $(QUANTIZE)

bundle: $(BUNDLE)/manifest.json

serve: $(SERVE_STAMP) $(BUNDLE)/manifest.json
	$(XMCSERVE) serve --bundle $(BUNDLE) --host $(HOST) --port $(PORT)

# The same API on Ray Serve (service/ray_serve): a local Ray cluster on this machine serving the
# default bundle built in 2 shards (an encoder, one deployment per shard, an ingress); config in
# deploy/ray/serve-config.yaml (host, port, replicas, resources). Ctrl-C stops it and the cluster.
RAY_BUNDLE ?= bundles/default-2shards
$(RAY_BUNDLE)/manifest.json: | $(STAMP)
	$(XMCSERVE) build --data $(DATA) --out $(RAY_BUNDLE) --index-kind rae_memory --dim 64 \
		--quantize $(QUANTIZE) --shards 2

serve-ray: $(STAMP) $(RAY_BUNDLE)/manifest.json
	RAY_USAGE_STATS_ENABLED=0 $(VENV)/bin/serve run deploy/ray/serve-config.yaml

evaluate: $(SERVE_STAMP) $(BUNDLE)/manifest.json
	$(XMCSERVE) evaluate --bundle $(BUNDLE) --data $(DATA) --split dev --out $(BUNDLE)-eval-dev.json

# Benchmarks write JSON (and PNG) under bench/results/; run one at a time (they share 2 cores).
# With BASELINE_REF (a commit), the CPU per request of everything but the encoder is measured for
# this tree and that commit in the same run (studies.non_encoder_cost), the commit checked out in a
# temporary worktree; in the same rounds, the floors (a bare ASGI app, a bare FastAPI route, under
# the same uvicorn settings) and each server's CPU by thread, so both trees' machinery is their
# CPU per request minus the floor's.
BASELINE_REF ?=
BASELINE_TREE := /tmp/xmcserve-baseline-$(BASELINE_REF)
bench-serving:
	$(MAKE) EXTRAS=cpu,train,dev,bench install bundle
	$(if $(BASELINE_REF),test -d $(BASELINE_TREE) || git worktree add --detach $(BASELINE_TREE) $(BASELINE_REF))
	$(PY) -m bench.serving --bundle $(BUNDLE) --null-encoder $(if $(BASELINE_REF),--baseline-tree $(BASELINE_TREE))

# One bundle served by 1 and by 2 worker processes (XMCSERVE_WORKERS), in turns, 3 rounds:
# idle p50 and closed-loop peak of each, bench/results/serving-workers.json (about 3 minutes).
WORKERS_ARGS ?=
bench-workers:
	$(MAKE) EXTRAS=cpu,train,dev,bench install bundle
	$(PY) -m bench.workers --bundle $(BUNDLE) $(WORKERS_ARGS)

# On a CUDA machine, in at most 8 minutes (tools/gpu/run.py): a CUDA bundle of the sample built and served
# on the CUDA execution provider (peak, idle p50, p99 at 70 % of peak, the null-encoder peak), then
# one server of 1, 2, 4, 8 CPU worker processes (XMCSERVE_WORKERS) on cores of their own; one JSON, bench/results/gpu.json. A venv of
# its own: onnxruntime-gpu and the other venvs' onnxruntime ship the same module, never both in one.
# torch is TORCH_PIN's build: a CUDA one encodes the bundle on the GPU, a CPU one on the CPU (the JSON
# says which). BENCH_GPU_ARGS=--dry-run runs the same stages on the CPU in under two minutes.
GPU_VENV ?= .venv-gpu
BENCH_GPU_ARGS ?=
bench-gpu:
	$(MAKE) VENV=$(GPU_VENV) EXTRAS=gpu,train install
	$(GPU_VENV)/bin/python -m tools.gpu $(BENCH_GPU_ARGS)

# Single server vs Ray Serve with 1, 2 and 4 shards at 1M synthetic labels (builds take ~35 min
# on 2 cores; built bundles are kept in /tmp/xmcserve-ray-scale).
bench-ray-scale:
	$(MAKE) EXTRAS=cpu,train,dev,bench install bundle
	$(PY) -m bench.ray_scale build
	$(PY) -m bench.ray_scale measure

# A million labels end to end on a synthetic data set of Debian-Related's shape (data/make_synthetic.py):
# generate, train (short CPU run), export in 2 shards, serve, evaluate; seconds and peak RSS per stage
# (about 27 minutes on 2 cores; scratch files in /tmp/xmcserve-million).
bench-million:
	$(MAKE) EXTRAS=cpu,train,dev,bench install
	$(PY) -m bench.million_e2e

# The compressed key index (--index ivfpq) against hnswlib, faiss HNSW over SQ8/PQ codes and usearch
# int8 HNSW on the same vectors: bytes a label, build time, recall@10, latency (bench/results/
# ann-compressed.json). REAL_BUNDLE: a bundle whose keys make the real set, REAL_DATA its data.
REAL_BUNDLE ?= bundles/default
REAL_DATA ?= $(DATA)
bench-ann-compressed:
	$(MAKE) EXTRAS=cpu,train,dev,bench install bundle
	$(PY) -m studies.ann_compressed --real-bundle $(REAL_BUNDLE) --real-data $(REAL_DATA)

# Ten million labels end to end: label keys drawn around the sample's label vectors (no 10^7 texts
# encoded; --vectors encoder generates and encodes them, hours here), build (--index ivfpq, label
# arrays), serve over HTTP with appends, recall against brute force (bench/results/ten-million.json;
# scratch in /tmp/xmcserve-ten-million).
bench-ten-million:
	$(MAKE) EXTRAS=cpu,train,dev,bench install
	$(PY) -m bench.ten_million

bench-ann:
	$(MAKE) EXTRAS=cpu,train,dev,bench install
	$(PY) -m bench.ann_scale

# A/B shadow cost (candidate B = the fp32 build of the default bundle) and the reload loop.
# bench-ab: nothing pinned: the shadow server shares this machine's cores with the primary.
# bench-ab-own-cores: the shadow server and the load generator on
# core 1, the primary alone on core 0, as a shadow of all traffic is meant to run.
AB_PLACEMENT ?= --primary-cpus 0 --shadow-cpus 1 --loadgen-cpus 1
$(BUNDLE)-fp32/manifest.json: | $(SERVE_STAMP)
	$(XMCSERVE) build --data $(DATA) --out $(BUNDLE)-fp32 --quantize none

bench-ab: $(STAMP) $(BUNDLE)/manifest.json $(BUNDLE)-fp32/manifest.json
	$(PY) -m bench.ab_shadow --bundle $(BUNDLE) --alt-bundle $(BUNDLE)-fp32

bench-ab-own-cores: $(STAMP) $(BUNDLE)/manifest.json $(BUNDLE)-fp32/manifest.json
	$(PY) -m bench.ab_shadow --bundle $(BUNDLE) --alt-bundle $(BUNDLE)-fp32 \
		$(AB_PLACEMENT) --out bench/results/ab-shadow-own-cores.json

# Open-loop load at 100 % and 150 % of the measured peak: tail, refusals and RSS under overload.
bench-overload: $(STAMP) $(BUNDLE)/manifest.json
	$(PY) -m bench.overload --bundle $(BUNDLE)

# Headless locust against a local server for 60 s; exits non-zero when an SLO is missed.
LOADTEST_ARGS ?= --scenario steady --seconds 60 --users 8 --p99-ms 250 --max-failure-ratio 0.01 --min-rps 20
loadtest: $(STAMP) $(BUNDLE)/manifest.json
	$(PY) -m loadtest.run --bundle $(BUNDLE) $(LOADTEST_ARGS)

# Container images, xmcserve-<flavour>:<pyproject version> (serve, loadtest, train, serve-gpu, ray),
# built by docker, podman or buildah, whichever is there (deploy/checks/runtime.py); figures go to
# DEPLOY_RESULTS. Build arguments come from the environment (TORCH_INDEX_URL=, PYTHON_IMAGE=...);
# IMAGE_ARGS=--stand-ins builds the CUDA and Ray images on local stand-in bases; --no-layer-cache
# keeps no intermediate layers (podman/buildah on vfs storage copy the filesystem per layer).
# torch from pip's own indexes (a local wheel dir) where PyTorch's is out of reach: TORCH_INDEX_URL=.
# Machines without a Docker engine: CONTAINER_TOOLS=<file defining ctr_build/ctr_run/ctr_podman>.
IMAGES ?= serve,loadtest,train,serve-gpu,ray
IMAGE_ARGS ?=
DEPLOY_RESULTS ?= bench/results/deploy-images.json
images:
	$(PYTHON) deploy/checks/build_images.py --only $(IMAGES) $(IMAGE_ARGS) --out $(DEPLOY_RESULTS)

# The serving image with a bundle mounted read-only: /readyz, /predict, /metrics, SIGTERM drain.
# CHECK_BUNDLE=<dir> mounts that bundle; by default bundles/default, else one the train image builds.
CHECK_BUNDLE ?=
image-check:
	$(PYTHON) deploy/checks/image_check.py $(if $(CHECK_BUNDLE),--bundle $(CHECK_BUNDLE)) --out $(DEPLOY_RESULTS)

# The compose stack's services as containers (host network): bundle, shadow, api, Prometheus and
# a locust SLO run from the load generator image. Reads docker-compose.yml with PyYAML.
# CHECK_BUNDLE=<dir> seeds the bundles volume with that bundle instead of running the bundle service.
compose-check:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) deploy/checks/compose_check.py $(if $(CHECK_BUNDLE),--bundle $(CHECK_BUNDLE)) \
		--out $(DEPLOY_RESULTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# pytest exits 5 when it collects nothing; that is reported, not failed. The test files run on
# TEST_WORKERS pytest-xdist workers (a file's tests stay on one, in order, with its module
# fixtures; the session's bundles are built once and shared: tests/conftest.py built_once): on 2
# cores about half of a serial run's wall time is spent waiting on servers and child processes.
# TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

sample:
	$(PYTHON) data/make_sample.py --src ../shared/data/debian-related --out $(DATA)

# The classical peers (PECOS XR-Linear, Omikuji Bonsai/Parabel, fastText supervised) get their own
# environment: libpecos pins numpy < 2 and scipy < 1.14. --no-deps keeps its unused torch/transformers
# requirements (a CUDA torch download) out; XR-Linear needs only numpy, scipy and scikit-learn.
# fastText is fasttext-wheel, the prebuilt package of fastText's own bindings (PyPI's fasttext is a
# source package that compiles at install).
PEERS_VENV ?= .venv-peers
$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet --disable-pip-version-check "numpy<2" "scipy<1.14" scikit-learn omikuji liblinear-official \
		fasttext-wheel==0.9.2
	$(PEERS_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps libpecos==1.2.8
	touch $@

peers-venv: $(PEERS_VENV)/.installed

# Annif (its fastText and Omikuji backends and their ensemble) as a peer, in an environment of its own:
# Annif pins numpy 2 and its own fastText build (fasttext-numpy2), which the peers venv's numpy < 2
# and fasttext-wheel are not. studies.annif_peer runs in it (the NLTK data its analyzers need is written
# by the runner: nothing is downloaded).
ANNIF_VENV ?= .venv-annif
$(ANNIF_VENV)/.installed:
	test -x $(ANNIF_VENV)/bin/python || $(PYTHON) -m venv $(ANNIF_VENV)
	$(ANNIF_VENV)/bin/pip install --quiet --disable-pip-version-check "annif[fasttext,omikuji]==1.4.3"
	touch $@

annif-venv: $(ANNIF_VENV)/.installed

# The serving peer, infinity-emb with its optimum (ONNX Runtime) engine, in an environment of its own:
# infinity pins numpy < 2. TORCH_PIN keeps optimum's torch the CPU build (infinity-emb 0.0.78 works
# with it); the other pins are the versions measured (bench/results/serving-infinity-peer.json),
# onnxruntime the serving venv's own, so both servers run the same ONNX Runtime.
INFINITY_VENV ?= .venv-infinity
INFINITY_PINS := "infinity-emb[server,optimum]==0.0.78" optimum==2.1.0 optimum-onnx==0.1.0 onnxruntime==1.32.0 \
	transformers==4.57.6 tokenizers==0.22.2 uvicorn==0.32.1 fastapi==0.165.0 numpy==1.26.4
$(INFINITY_VENV)/.installed:
	test -x $(INFINITY_VENV)/bin/python || $(PYTHON) -m venv $(INFINITY_VENV)
	$(INFINITY_VENV)/bin/pip install --quiet --disable-pip-version-check "$(TORCH_PIN)" $(INFINITY_PINS)
	touch $@

infinity-venv: $(INFINITY_VENV)/.installed

# /predict beside infinity-emb's /embeddings on the same MiniLM weights (int8 ONNX, this project's
# export recipe), the same cores and dev texts, in alternating turns (bench.serving --peer infinity).
# The peer's model folder is made on the first run (torch, from the train extra) in /tmp/xmcserve-bench.
PEER_ARGS ?= --seconds 6 --rounds 2
bench-infinity: $(INFINITY_VENV)/.installed
	$(MAKE) EXTRAS=cpu,train,dev,bench install bundle
	$(PY) -m bench.serving --bundle $(BUNDLE) --peer infinity --peer-venv $(INFINITY_VENV) $(PEER_ARGS)

# UniDEC training on the full Debian-Related split (CPU: frozen lower layers, cached), and the
# two-minute smoke configuration the tests use. NPROC=N trains data-parallel on N processes
# (torchrun + DDP: one per GPU over NCCL, or CPU processes over gloo); batch_size stays the global batch.
TRAIN_CONFIG ?= debian-unidec
NPROC ?= 1
TRAIN_LAUNCH = $(if $(filter 1,$(NPROC)),$(PY),$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC))
train: $(SERVE_STAMP)
	$(TRAIN_LAUNCH) -m training.train --config $(TRAIN_CONFIG)

train-smoke: $(SERVE_STAMP)
	$(XMCSERVE) train --config smoke

# The trained bundle: `make train`'s checkpoint as an RAE memory (the best of training.sweep and of
# studies.quality's λ sweep on dev) with its score fusion fitted on the run's held-out instances
# (export.fuse's defaults: the choice of studies.fusion_models, docs/score-fusion.md). Serve it with
# `make serve BUNDLE=bundles/debian-unidec`.
TRAINED_RUN ?= runs/debian-unidec
TRAINED_DATA ?= ../shared/data/debian-related
TRAINED_BUNDLE ?= bundles/debian-unidec
TRAINED_MEMORY_ARGS ?= --rae-mode split --rae-tau 0.04 --rae-top-b 200 --rae-lambda 0.2
FUSE_ARGS ?=
$(TRAINED_BUNDLE)-memory/manifest.json: | $(SERVE_STAMP)
	test -f $(TRAINED_RUN)/best/head.json || { echo "no $(TRAINED_RUN)/best: run make train first" >&2; exit 1; }
	$(XMCSERVE) build --data $(TRAINED_DATA) --checkpoint $(TRAINED_RUN)/best --out $(TRAINED_BUNDLE)-memory \
		--index-kind rae_memory $(TRAINED_MEMORY_ARGS)

$(TRAINED_BUNDLE)/manifest.json: $(TRAINED_BUNDLE)-memory/manifest.json
	$(XMCSERVE) fuse --bundle $(TRAINED_BUNDLE)-memory --run $(TRAINED_RUN) --data $(TRAINED_DATA) \
		--out $(TRAINED_BUNDLE) $(FUSE_ARGS)

trained-bundle: $(TRAINED_BUNDLE)/manifest.json

# A user's own data (docs/own-data.md layout) to a trained, fused bundle in one command: training
# sized to the data, the trained RAE memory, the score fusion with its sparse ranker, and the
# pretrained memory with the same fusion as a rival (the better held-out validation is shipped);
# with a dev split, the bundle beside TF-IDF + one-vs-rest LR in <run>/fit-report.json (export.fit
# prints the plan and an estimate of the wall time first). RUN: the training run's directory.
# RECIPE: another training recipe (a shipped one's name, or a YAML file).
RUN ?=
RECIPE ?=
fit: $(SERVE_STAMP)
	$(XMCSERVE) fit --data $(DATA) --bundle $(BUNDLE) $(if $(RUN),--run $(RUN)) $(if $(RECIPE),--recipe $(RECIPE))

# Dev-split quality of the peers and of xmcserve's bundles -> bench/results/quality-debian-dev.*
# The RAE settings of the trained memory are the best of `python -m training.sweep` on dev.
QUALITY_ARGS ?= --rae-mode split --rae-tau 0.04 --rae-top-b 200
bench-quality: $(STAMP) $(PEERS_VENV)/.installed
	$(MAKE) EXTRAS=cpu,train,dev,bench install
	$(PY) -m studies.quality --peers-python $(PEERS_VENV)/bin/python $(QUALITY_ARGS)

# A data set no default was tuned on, as a user meets it: every peer, export.build's defaults and
# make fit's bundle (no setting changed), with and without the default fusion ->
# bench/results/quality-<folder>-dev.*  Hours on 2 cores (make fit trains; the one-vs-rest peer fits
# each label alone); the workdir keeps what was built, so a rerun only evaluates.
QUALITY_DATA ?= data/gutenberg-subjects
bench-quality-fit: $(STAMP) $(PEERS_VENV)/.installed
	$(MAKE) EXTRAS=cpu,train,dev,bench install
	$(PY) -m studies.quality --user-route --data $(QUALITY_DATA) --peers-python $(PEERS_VENV)/bin/python \
		--workdir bundles/quality-$(notdir $(QUALITY_DATA))

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(ANNIF_VENV) $(INFINITY_VENV) $(GPU_VENV) bundles runs .pytest_cache .ruff_cache
