"""The single server's guards on their own: the load shed's decision and the bounded method label
(the front door that applies them: tests/service/api/test_front_door.py)."""

from service.http.guards import LoadShed, method_label


def test_the_shed_refuses_only_predict_and_only_past_the_deadline():
    shed = []
    waits = {"now": 2.0}
    guard = LoadShed(lambda: waits["now"], deadline_s=1.0, on_shed=lambda: shed.append(1))
    assert "about 2000 ms of work queued" in guard.refusal({"path": "/predict", "method": "POST"})
    assert guard.refusal({"path": "/healthz", "method": "GET"}) is None
    assert guard.refusal({"path": "/predict", "method": "GET"}) is None
    waits["now"] = 0.5
    assert guard.refusal({"path": "/predict", "method": "POST"}) is None
    waits["now"] = None  # not serving yet
    assert guard.refusal({"path": "/predict", "method": "POST"}) is None
    assert shed == [1]


def test_methods_map_to_a_fixed_set():
    assert method_label("POST") == "POST" and method_label("BREW") == "OTHER" and method_label("post") == "OTHER"
