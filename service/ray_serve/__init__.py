"""xmcserve on Ray Serve: one bundle's shards on as many machines as it needs.

A second front end over the engine (:mod:`engine`), beside the single uvicorn server,
for label sets that do not fit one machine; both serve the API of :mod:`service.api` and
import nothing of each other. Importable only where ``ray[serve]`` is installed
(``pip install 'xmcserve[ray]'``); nothing else in ``service/`` imports it.

The application (:func:`~service.ray_serve.app.build_app`) is three kinds of deployment:

* ``encoder`` — the bundle's ONNX encoder, texts → 64-d vectors, batched by ``@serve.batch``;
* ``shard-<i>`` — one per shard of a sharded bundle (``export.build --shards N``): its HNSW
  index and, for an RAE memory, its rows of V; nearest keys + value rows per query batch;
* ``ingress`` — the same HTTP API as the single server (``/predict``, ``/healthz``, ``/readyz``,
  ``/info``): validates, encodes, fans out to every shard with a deadline, merges the per-shard
  top-n exactly (:func:`~engine.shards.merge_answers`) and ranks them as the single
  server does (:func:`~engine.search.rank_batch`), so the answers equal its answers.

Run it with ``serve run deploy/ray/serve-config.yaml`` (``make serve-ray``) or a KubeRay
``RayService`` (deploy/k8s/ray/rayservice.yaml); deploy/README.md says how.
"""

from service.ray_serve.app import AppArgs, build_app

__all__ = ["AppArgs", "build_app"]
