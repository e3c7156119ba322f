"""Lanes and one-off model work off the event loop's thread: thread counts, results, errors."""

import threading
import time

import anyio
import pytest
import torch

from pdflash.engine.lanes import BatchLane, Lane, drafter_has_own_lane, lane_threads, off_thread

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no device


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


@pytest.mark.parametrize(
    ("device", "offloaded", "threads", "own"),
    [
        (CPU, False, 1, True),  # its lane adds a thread: the target keeps its one
        (CPU, False, 2, False),  # its lane would halve every verify's threads
        (CPU, False, 3, False),
        (CPU, False, 4, True),  # a quarter at most: kept (not measured)
        (CPU, True, 2, True),  # offloaded: drafts fill a verify's waits on the link
        (CUDA, False, 2, True),  # a stream of its own, no thread taken
    ],
)
def test_auto_shares_the_target_lane_only_resident_on_a_cpu_of_two_or_three_threads(device, offloaded, threads, own):
    assert drafter_has_own_lane("auto", device=device, offloaded=offloaded, threads=threads) is own
    assert lane_threads(threads, drafter=own) == ((max(1, threads - 1), 1) if own else (threads, 0))


def test_own_and_shared_are_what_they_say_and_anything_else_is_refused():
    for device, offloaded, threads in [(CPU, False, 2), (CPU, True, 1), (CUDA, False, 8)]:
        assert drafter_has_own_lane("own", device=device, offloaded=offloaded, threads=threads)
        assert not drafter_has_own_lane("shared", device=device, offloaded=offloaded, threads=threads)
    with pytest.raises(ValueError, match="drafter_lane='both' is not one of 'auto', 'own', 'shared'"):
        drafter_has_own_lane("both", device=CPU, offloaded=False, threads=2)


@pytest.mark.asyncio
async def test_a_batch_lane_counts_the_seconds_its_calls_ran_not_their_wait_for_the_lane():
    lane = Lane("shared", CPU)
    drafts = BatchLane(lane, lambda items: [time.sleep(0.02) or i for i in items], name="draft")
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(drafts.serve)
            blocker = lane.submit(time.sleep, 0.2)  # another lane user runs first: the batch waits for it
            assert await drafts.submit(7) == 7
            assert blocker.done()
            tg.cancel_scope.cancel()
    finally:
        lane.close()
    assert 0.02 <= drafts.busy_s < 0.15  # its own call, not the 0.2 s it waited behind
    assert lane.busy_s >= 0.22


@pytest.mark.asyncio
async def test_a_batch_lane_is_working_while_items_wait_or_run_and_idle_after():
    lane = Lane("shared", CPU)
    drafts = BatchLane(lane, lambda items: [time.sleep(0.02) or i for i in items], name="draft")
    done = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(drafts.serve)
            assert not drafts.working
            lane.submit(time.sleep, 0.1)  # the batch waits behind it: queued, not yet running

            async def submit() -> None:
                assert await drafts.submit(3) == 3
                done.set()

            tg.start_soon(submit)
            await anyio.sleep(0.03)
            assert drafts.working  # its batch waits behind the other lane user
            with anyio.fail_after(5):
                await done.wait()
            assert not drafts.working
            tg.cancel_scope.cancel()
    finally:
        lane.close()


@pytest.mark.asyncio
async def test_held_items_ride_another_call_or_run_alone_once_released():
    """While `hold` answers True, submitted items wait: a ride hands them to another call, which
    answers each (an error to its own item only); released, the lane runs what still waits."""
    lane = Lane("target", CPU)
    held = True
    prefills = BatchLane(lane, lambda items: [i * 10 for i in items], name="prefill", hold=lambda: held)
    answers: dict[int, object] = {}

    async def submit(item: int) -> None:
        try:
            answers[item] = await prefills.submit(item)
        except ValueError as error:
            answers[item] = str(error)

    try:
        async with anyio.create_task_group() as tg:
            await tg.start(prefills.serve)
            assert prefills.ride() is None  # nothing waits
            tg.start_soon(submit, 1)
            tg.start_soon(submit, 2)
            await anyio.sleep(0.02)
            assert answers == {} and prefills.batches == 0  # held
            ride = prefills.ride()
            assert ride is not None and ride.items == [1, 2]
            ride.finish([100, ValueError("bad prompt")])
            ride.fail(RuntimeError("answered already: changes nothing"))
            await anyio.sleep(0.01)
            assert answers == {1: 100, 2: "bad prompt"}
            tg.start_soon(submit, 3)
            await anyio.sleep(0.02)
            assert 3 not in answers
            held = False
            prefills.release()
            with anyio.fail_after(5):
                while 3 not in answers:
                    await anyio.sleep(0.005)
            tg.cancel_scope.cancel()
    finally:
        lane.close()
    assert answers[3] == 30 and (prefills.batches, prefills.rides) == (1, 1)


@pytest.mark.asyncio
async def test_a_waiter_cancelled_while_its_item_rides_waits_for_the_ride_to_answer():
    lane = Lane("target", CPU)
    prefills = BatchLane(lane, lambda items: items, name="prefill", hold=lambda: True)
    returned_at: list[float] = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(prefills.serve)
            scope = anyio.CancelScope()

            async def waiter() -> None:
                with scope:
                    await prefills.submit(5)
                returned_at.append(time.perf_counter())

            tg.start_soon(waiter)
            await anyio.sleep(0.01)
            ride = prefills.ride()
            assert ride is not None
            scope.cancel()
            await anyio.sleep(0.05)
            assert not returned_at  # its item is in another call: the waiter may not free it yet
            answered = time.perf_counter()
            ride.finish([5])
            with anyio.fail_after(5):
                while not returned_at:
                    await anyio.sleep(0.005)
            assert returned_at[0] >= answered
            tg.cancel_scope.cancel()
    finally:
        lane.close()
