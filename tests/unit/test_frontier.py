"""Frontier-group dispatch's count (services/rollout/frontier.py): the batch, then the group,
closest to complete is served first (a lower priority value)."""

from services.rollout.frontier import Frontier


def test_a_batch_with_fewer_episodes_left_comes_first_then_its_group_closest_to_complete():
    small, large = Frontier(groups=2, group_size=4), Frontier(groups=8, group_size=4)
    assert small.priority(0) < large.priority(0)
    for _ in range(3):
        small.done(1)
    assert small.priority(1) < small.priority(0)  # within the batch: the group with one episode left
    ask = small.of(0)
    before = ask()
    small.done(0)
    assert ask() < before  # asked again at each turn: the count as it is then


def test_the_count_never_goes_below_zero():
    frontier = Frontier(groups=1, group_size=1)
    frontier.done(0), frontier.done(0)
    assert frontier.left == [0] and frontier.priority(0) == 0
