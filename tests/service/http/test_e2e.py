"""End to end: a bundle built from the sample, served by a real uvicorn process."""

import pytest
from httpx import Client

from engine.bundle import load_bundle
from engine.offline import exact_rankings, recall_with_label_ties
from service.api.schemas import PredictResponse
from xmc.data import load_jsonl_split

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(live_server):
    with Client(base_url=live_server.url, timeout=30) as c:
        yield c


def test_predict_returns_k_real_labels_best_first(client):
    r = client.post("/predict", json={"text": "python3-numpy: Fast array facility to the Python 3 language", "k": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    PredictResponse.model_validate(body)  # the hand-serialised answer matches the documented schema
    assert body["bundle_id"].startswith("rae-memory-64d-") and body["index_kind"] == "rae_memory"
    assert body["variant"] == "A"
    labels = body["results"][0]["labels"]
    assert len(labels) == 5
    scores = [label["score"] for label in labels]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0
    uids = [label["uid"] for label in labels]
    assert "python3" in uids  # numpy's real dependency, memorised from the training instance
    assert all(label["text"].startswith(label["uid"] + ":") for label in labels)


def test_exclude_removes_the_same_item_before_the_softmax(client):
    text = "python3-numpy: Fast array facility to the Python 3 language"
    plain = client.post("/predict", json={"text": text, "k": 20}).json()["results"][0]["labels"]
    excluded = client.post("/predict", json={"text": text, "k": 20, "exclude": ["python3-numpy"]}).json()
    labels = excluded["results"][0]["labels"]
    assert "python3-numpy" in [x["uid"] for x in plain]
    assert "python3-numpy" not in [x["uid"] for x in labels]
    # The same-item label key no longer takes softmax mass, so the others' scores rise.
    before = {x["uid"]: x["score"] for x in plain}
    assert labels[0]["score"] > before[labels[0]["uid"]]


def test_batch_answers_in_order(client):
    texts = ["vim-gtk3: Vi IMproved - enhanced vi editor", "libssl-dev: Secure Sockets Layer toolkit"]
    batch = client.post("/predict", json={"texts": texts, "k": 3}).json()["results"]
    singles = [client.post("/predict", json={"text": t, "k": 3}).json()["results"][0] for t in texts]
    assert [[x["id"] for x in r["labels"]] for r in batch] == [[x["id"] for x in r["labels"]] for r in singles]


def test_recall_at_10_against_exact_search(client, sample_bundle, sample_dir):
    """HTTP answers vs exact brute force over the same key vectors and the same aggregation."""
    bundle = load_bundle(sample_bundle)
    texts = load_jsonl_split(sample_dir, "dev").texts[:96]
    served = []
    for start in range(0, len(texts), 32):
        body = client.post("/predict", json={"texts": texts[start : start + 32], "k": 10}).json()
        served += [[x["id"] for x in r["labels"]] for r in body["results"]]
    vectors, _ = bundle.encoder.encode(texts)
    recall = recall_with_label_ties(exact_rankings(bundle, vectors, 20), served, 10)
    assert recall >= 0.95


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"text": ""}, "empty or whitespace"),
        ({"text": "   "}, "empty or whitespace"),
        ({"text": "ok", "k": 0}, "greater than or equal to 1"),
        ({"text": "ok", "k": 1001}, "less than or equal to 1000"),
        ({"texts": ["t"] * 65}, "at most 64 items"),
        ({"text": "x" * 2049}, "2049 bytes of UTF-8; the limit is 2048"),
        ({"k": 5}, "exactly one of 'text' or 'texts'"),
        ({"text": 5}, "valid string"),
    ],
)
def test_bad_input_is_a_clear_422(client, body, fragment):
    r = client.post("/predict", json=body)
    assert r.status_code == 422
    assert fragment in r.text


def test_malformed_json_is_422(client):
    r = client.post("/predict", content=b'{"text": "unterminated', headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert "JSON decode error" in r.text


def test_service_keeps_answering_after_bad_input(client):
    assert client.post("/predict", json={"text": ""}).status_code == 422
    assert client.post("/predict", json={"text": "libc6: GNU C Library", "k": 1}).status_code == 200


def test_health_ready_info(client, sample_bundle):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    info = client.get("/info").json()
    assert ready["ready"] is True and ready["bundle_id"] == info["manifest"]["bundle_id"]
    assert info["execution_provider"] == "CPUExecutionProvider"
    assert info["manifest"]["dim"] == 64 and info["manifest"]["rae"]["top_b"] == 200
    # the bundle's card: what made it, from the bundle's own checksummed card.json
    card = info["card"]
    assert (
        card["bundle_id"] == info["manifest"]["bundle_id"]
        and card["data"]["labels"] == info["manifest"]["counts"]["labels"]
    )
    assert card["model"]["dim"] == 64 and card["made"]["command"]


def test_openapi_has_request_examples(client):
    schema = client.get("/openapi.json").json()
    assert any("examples" in s for s in schema["components"]["schemas"].values())
    answer = schema["paths"]["/predict"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer["$ref"].endswith("/PredictResponse")


def test_metrics_are_exported(client):
    client.post("/predict", json={"text": "bash: GNU Bourne Again SHell", "k": 3})
    client.post("/predict", json={"text": ""})
    text = client.get("/metrics").text
    assert 'xmcserve_request_duration_seconds_count{endpoint="/predict",method="POST",status="200",variant="A"}' in text
    assert 'xmcserve_request_duration_seconds_count{endpoint="/predict",method="POST",status="422",variant="-"}' in text
    for stage in ("queue", "tokenize", "encode", "search", "aggregate"):
        assert f'xmcserve_stage_duration_seconds_count{{stage="{stage}",variant="A"}}' in text
    assert "xmcserve_bundle_info{" in text
    assert "xmcserve_batch_size_texts_bucket" in text
    assert 'xmcserve_queue_depth{variant="A"}' in text and 'xmcserve_batches_in_flight{variant="B"}' in text
    assert "xmcserve_in_flight_requests " in text
    predicted = [line for line in text.splitlines() if line.startswith('xmcserve_predicted_texts_total{variant="A"}')]
    assert predicted and float(predicted[0].rsplit(" ", 1)[1]) >= 1
    assert 'xmcserve_rejected_requests_total{variant="B"} 0.0' in text
    # every xmcserve series names its variant, but the server-wide count of HTTP requests in flight
    series = [line for line in text.splitlines() if line.startswith("xmcserve_")]
    unlabelled = [line for line in series if 'variant="' not in line and not line.startswith("xmcserve_in_flight")]
    assert series and not unlabelled, unlabelled
