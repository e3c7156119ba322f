"""Lanes and one-off model work off the event loop's thread: thread counts, results, errors."""

import threading

import pytest
import torch

from pdflash.engine.lanes import Lane, off_thread


def test_a_lane_uses_the_torch_thread_count_of_the_thread_that_created_it():
    before = torch.get_num_threads()
    torch.set_num_threads(7)  # thread-local in OpenMP: a new thread would start at its default
    try:
        lane = Lane("test", torch.device("cpu"))
        assert off_thread(torch.get_num_threads) == 7
    finally:
        torch.set_num_threads(before)
    try:
        assert lane.submit(torch.get_num_threads).result() == 7
    finally:
        lane.close()


def test_off_thread_runs_elsewhere_and_returns_or_raises():
    assert off_thread(threading.get_ident) != threading.get_ident()

    def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        off_thread(fail)
