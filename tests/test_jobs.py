"""The job state table (jobs.py): every legal move, and nothing else."""

from __future__ import annotations

import itertools

import pytest

from fillmask_server.jobs import TRANSITIONS, Event, IllegalTransition, Job, State, advance, can
from fillmask_server.protocol import FillMaskRequest


def job_in(state: State) -> Job:
    job = Job(FillMaskRequest(1, "a [MASK]", 5), owner=None, arrival=0.0)
    job.state = state  # test set-up only; code moves jobs with advance()
    return job


def test_the_happy_path_and_every_way_out() -> None:
    job = job_in(State.TOKENIZING)
    for event, state in [(Event.CHECKED, State.QUEUED), (Event.BATCHED, State.RUNNING),
                         (Event.FORWARDED, State.DECODING), (Event.DECODED, State.DONE)]:
        advance(job, event)
        assert job.state is state


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)))
def test_every_pair_outside_the_table_raises_and_leaves_the_state(state: State, event: Event) -> None:
    job = job_in(state)
    if (state, event) in TRANSITIONS:
        assert can(job, event)
        advance(job, event)
        assert job.state is TRANSITIONS[(state, event)]
    else:
        assert not can(job, event)
        with pytest.raises(IllegalTransition):
            advance(job, event)
        assert job.state is state


def test_done_is_final_and_withdrawing_is_only_possible_before_the_model() -> None:
    assert not any(state is State.DONE for state, _ in TRANSITIONS)  # nothing leaves DONE: one outcome
    withdrawable = {state for state, event in TRANSITIONS if event is Event.WITHDRAWN}
    assert withdrawable == {State.TOKENIZING, State.QUEUED}  # §5/§6: a started request is never cut short
