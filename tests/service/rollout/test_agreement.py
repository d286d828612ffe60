"""The rollout page's ring of recent shadow comparisons: bounded, windowed, worst first."""

from service.rollout.agreement import AgreementHistory


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_ring_keeps_the_last_entries_only():
    history = AgreementHistory(capacity=3, clock=Clock())
    history.add_compared((f"t{i}", 5, 1.0, 1.0, 0.0, 0.001) for i in range(5))
    compared, _ = history.since(60)
    assert [c.text for c in compared] == ["t2", "t3", "t4"]


def test_the_window_leaves_older_entries_out_and_drops_share_a_second():
    clock = Clock()
    history = AgreementHistory(clock=clock)
    history.add_compared([("old", 5, 0.2, None, None, 0.0)])
    history.add_dropped("timeout", 2)
    clock.now += 100
    history.add_compared([("new", 5, 0.8, 0.5, 0.01, 0.0)])
    history.add_dropped("queue_full", 1)
    history.add_dropped("queue_full", 3)  # same second, same reason: one event
    history.add_dropped("error", 1)
    compared, dropped = history.since(60)
    assert [c.text for c in compared] == ["new"]
    assert dropped == [(1100, "queue_full", 4), (1100, "error", 1)]
    assert len(history.since(200)[1]) == 3


def test_worst_is_lowest_overlap_then_lowest_correlation_one_per_text():
    clock = Clock()
    history = AgreementHistory(clock=clock)
    history.add_compared(
        [
            ("agree", 5, 1.0, 1.0, 0.0, 0.0),
            ("half", 5, 0.6, 0.9, 0.0, 0.0),
            ("half reversed", 5, 0.6, -1.0, 0.0, 0.0),
            ("apart", 5, 0.2, None, None, 0.0),
            ("apart", 5, 0.2, None, None, 0.0),  # asked twice: listed once
        ]
    )
    compared, _ = history.since(60)
    assert [c.text for c in history.worst(compared, 3)] == ["apart", "half reversed", "half"]
