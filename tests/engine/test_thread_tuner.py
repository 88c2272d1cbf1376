"""The per-forward choice of CPU threads: measured, kept to the faster count, re-checked when load changes."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from corral.server.engine import Engine, EngineConfig, SamplingParams, SeqOutput
from corral.server.engine import Sequence as Seq
from corral.server.engine.thread_tuner import ThreadTuner, forward_key
from corral.server.models import load_model
from corral.server.settings import Settings


def _run(tuner: ThreadTuner, key: object, cost: dict[int, float], visits: int) -> list[int]:
    """`visits` forwards where each count costs `cost[count]` ms; the counts chosen, in order."""
    chosen = []
    for _ in range(visits):
        threads = tuner.choose(key)
        tuner.record(key, threads, cost[threads])
        chosen.append(threads)
    return chosen


def test_each_count_is_measured_first_then_the_faster_one_runs() -> None:
    tuner = ThreadTuner((1, 2), warmup=2, explore_every=10)
    chosen = _run(tuner, "k", {1: 70.0, 2: 50.0}, 40)
    assert chosen[:4].count(1) == 2 and chosen[:4].count(2) == 2
    assert tuner.best("k") == 2
    # Then only re-checks of one thread: at visit 10, and, since it was far slower (70 >= 1.25 x 50), 20 later.
    assert [visit for visit, threads in enumerate(chosen, 1) if threads == 1 and visit > 4] == [10, 30]


def test_re_checks_of_a_far_slower_count_back_off_to_a_limit_and_reset_when_it_comes_close() -> None:
    """Each re-check costs a forward its difference (one thread against two on Gemma 3 at one row: ~49
    against ~28 ms), so a count that stays far slower is re-tried ever more rarely, though at least every
    `max_backoff` x `explore_every` visits; one that comes within `far_slower` is re-tried at the base rate."""
    tuner = ThreadTuner((1, 2), warmup=1, explore_every=10, max_backoff=4)
    chosen = _run(tuner, "k", {1: 49.0, 2: 28.0}, 300)
    rechecks = [visit for visit, threads in enumerate(chosen, 1) if threads == 1 and visit > 2]
    assert rechecks[:4] == [10, 30, 70, 110]  # intervals 20, 40, then the limit: 40
    assert all(b - a == 40 for a, b in itertools.pairwise(rechecks[2:]))
    close = ThreadTuner((1, 2), warmup=1, explore_every=10, max_backoff=4)
    chosen = _run(close, "k", {1: 30.0, 2: 28.0}, 100)
    assert [v for v, t in enumerate(chosen, 1) if t == 1 and v > 2] == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    # A backed-off count that becomes the faster one is found at its next re-check and then runs.
    later = _run(tuner, "k", {1: 20.0, 2: 28.0}, 40)
    assert later[-5:] == [1] * 5 and tuner.best("k") == 1


def test_a_count_that_becomes_slow_is_left_and_the_other_re_checked() -> None:
    """The second core gets busy: two threads go from the faster to far the slower (measured on Gemma 3
    at one row, 51 -> 185 ms), and the tuner moves to one thread within a forward or two."""
    tuner = ThreadTuner((1, 2), warmup=2, explore_every=8)
    _run(tuner, "k", {1: 70.0, 2: 50.0}, 20)
    assert tuner.best("k") == 2
    busy = _run(tuner, "k", {1: 85.0, 2: 185.0}, 40)
    assert busy[-24:].count(2) <= 3 + 1  # the re-checks only
    assert tuner.best("k") == 1
    _run(tuner, "k", {1: 70.0, 2: 50.0}, 40)  # the core frees again: a re-check finds it
    assert tuner.best("k") == 2


def test_keys_are_measured_apart() -> None:
    tuner = ThreadTuner((1, 2), warmup=1, explore_every=100)
    _run(tuner, forward_key(False, 1), {1: 70.0, 2: 50.0}, 10)
    _run(tuner, forward_key(True, 1), {1: 60.0, 2: 90.0}, 10)
    assert tuner.best(forward_key(False, 1)) == 2
    assert tuner.best(forward_key(True, 1)) == 1
    assert forward_key(False, 5) == forward_key(False, 7) != forward_key(False, 8)


def test_one_choice_or_a_bad_one() -> None:
    assert _run(ThreadTuner((3,)), "k", {3: 1.0}, 5) == [3] * 5
    with pytest.raises(ValueError, match="positive"):
        ThreadTuner((0, 1))


def test_settings_offer_all_cores_but_one_and_all_unless_threads_are_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert Settings().cpu_thread_choices() == (1, 2)
    assert Settings(torch_threads=2).cpu_thread_choices() == (2,)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert Settings().cpu_thread_choices() == (1,)


def test_the_engine_measures_both_counts_and_answers_as_with_one() -> None:
    loaded = load_model("corral-tiny", device="cpu")
    before = torch.get_num_threads()
    try:
        outputs = []
        for choices in [(1,), (1, 2)]:
            torch.set_num_threads(1)
            engine = Engine(loaded, EngineConfig(max_batch=2, max_model_len=256, thread_choices=choices))
            done: list[SeqOutput] = []
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            seq = Seq(request_id="a", prompt_ids=[2, 10, 11, 12], params=params, sink=done.append, streaming=False)
            engine.add_request(seq)
            while not seq.is_finished:
                engine.step()
            outputs.append(seq.output_ids)
        assert engine.threads is not None
        measured = engine.threads.snapshot()[str(forward_key(False, 1))]
        assert set(measured) == {1, 2}  # each count ran one-token forwards and was timed
        assert outputs[0] == outputs[1]
    finally:
        torch.set_num_threads(before)


def test_one_configured_count_is_set_on_the_thread_that_steps() -> None:
    loaded = load_model("corral-tiny", device="cpu")
    engine = Engine(loaded, EngineConfig(max_batch=2, max_model_len=256, thread_choices=(2,)))
    seen: list[int] = []

    def loop() -> None:  # a fresh thread, as the engine loop's is, starting from one torch thread
        torch.set_num_threads(1)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        seq = Seq(request_id="a", prompt_ids=[2, 10, 11], params=params, sink=lambda out: None, streaming=False)
        engine.add_request(seq)
        engine.step()
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    assert seen == [2]
    assert torch.get_num_threads() == before  # the caller's thread is left alone


def test_a_prompt_runs_on_every_thread_without_trials() -> None:
    """Large forwards (prompts) take all the threads and are never measured on fewer: a trial would cost the
    whole prompt twice over; steps of few tokens keep their trials."""
    from corral.server.engine.thread_tuner import LARGE_FORWARD_TOKENS, TorchThreads, choose_threads

    tuner = ThreadTuner([1, 2], warmup=2)
    threads = TorchThreads()
    used: list[int] = []
    threads.use = used.append  # type: ignore[method-assign]
    for _ in range(5):
        assert choose_threads(tuner, threads, False, LARGE_FORWARD_TOKENS) is None
    assert used == [2] * 5 and tuner.snapshot() == {}
    chosen = choose_threads(tuner, threads, False, 1)
    assert chosen is not None and chosen[1] == 1  # a decode step still tries the first count first
