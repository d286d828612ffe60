import pytest
from pydantic import ValidationError

from service.api.limits import LimitSettings
from service.api.schemas import build_predict_request

PredictRequest = build_predict_request(LimitSettings(max_texts_per_request=3, max_text_bytes=20, max_k=50))


def error_text(**body) -> str:
    with pytest.raises(ValidationError) as info:
        PredictRequest(**body)
    return str(info.value)


def test_single_and_batch_requests():
    single = PredictRequest(text="libc6", k=5)
    assert single.all_texts() == ["libc6"] and single.exclusions() == [[]]
    batch = PredictRequest(texts=["a", "b"], exclude=["x"])
    assert batch.all_texts() == ["a", "b"] and batch.exclusions() == [["x"], ["x"]]
    per_text = PredictRequest(texts=["a", "b"], exclude=[["x"], []])
    assert per_text.exclusions() == [["x"], []]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text": ""}, "empty or whitespace"),
        ({"text": " \t\n"}, "empty or whitespace"),
        ({"texts": ["ok", "  "]}, "texts[1]: text is empty"),
        ({"text": "é" * 11}, "22 bytes of UTF-8; the limit is 20"),
        ({"text": "ok", "k": 0}, "greater than or equal to 1"),
        ({"text": "ok", "k": 51}, "less than or equal to 50"),
        ({"texts": ["a", "b", "c", "d"]}, "at most 3 items"),
        ({"texts": []}, "at least 1 item"),
        ({}, "exactly one of 'text' or 'texts'"),
        ({"text": "a", "texts": ["b"]}, "exactly one of 'text' or 'texts'"),
        ({"texts": ["a", "b"], "exclude": [["x"]]}, "1 lists for 2 texts"),
        ({"text": "a", "ef": 0}, "greater than or equal to 1"),
        ({"text": "a", "colour": "red"}, "Extra inputs are not permitted"),
    ],
)
def test_bad_requests_say_what_is_wrong(body, message):
    assert message in error_text(**body)


def test_openapi_examples_are_valid_requests():
    model = build_predict_request(LimitSettings())
    examples = model.model_json_schema()["examples"]
    assert len(examples) == 2
    for example in examples:
        model(**example)
