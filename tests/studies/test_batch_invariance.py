"""studies.batch_invariance: the check finds an answer that moves with its batch, and the CLI
records each bundle's result."""

import json

import numpy as np

from studies.batch_invariance.run import batch_invariance, main


class Ranking:
    def __init__(self, ids, scores):
        self.ids, self.scores = np.array(ids), np.array(scores, dtype=np.float32)


class BatchSizeLeaks:
    """A predictor whose scores move with the size of the batch, past ``threshold`` texts its labels too."""

    def __init__(self, threshold: int):
        self.threshold = threshold

    def predict(self, texts, k):
        shift = 1e-5 * (len(texts) - 1)
        order = [1, 0] if len(texts) > self.threshold else [0, 1]

        class Answer:
            rankings = [Ranking(order, [0.9 + shift, 0.8]) for _ in texts]

        return Answer()


def test_scores_or_labels_that_move_with_the_batch_are_found():
    texts = [f"text {i}" for i in range(40)]
    moved = batch_invariance(BatchSizeLeaks(threshold=1000), texts, batches=5)
    assert not moved.holds and moved.other_labels == 0 and moved.max_abs_score_diff > 1e-6
    reordered = batch_invariance(BatchSizeLeaks(threshold=1), texts, batches=5)
    assert reordered.other_labels > 0 and "other labels" in reordered.first_difference


def test_the_cli_records_each_bundle(sample_bundle, sample_dir, tmp_path):
    out = tmp_path / "invariance.json"
    main(
        [
            "--bundle",
            str(sample_bundle),
            "--data",
            str(sample_dir),
            "--texts",
            "30",
            "--batches",
            "4",
            "--out",
            f"{out}",
        ]
    )
    (row,) = json.loads(out.read_text())["bundles"].values()
    assert row["holds"] and row["compared"] > 0 and row["other_labels"] == 0
