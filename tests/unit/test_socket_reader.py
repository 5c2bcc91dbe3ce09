"""ipc.drain and frontend/socket_reader.py over real ZMQ sockets: the receiver thread and an asyncio loop take
turns reading one socket, every message arrives exactly once and in order across the moves, and neither a
handler that raises nor a message that cannot be decoded stops the reading, on the loop or on the thread."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import zmq

from tokenloom.frontend.socket_reader import SocketReader
from tokenloom.ipc import Receiver, Sender


def pair(tmp_path):
    ctx = zmq.Context()
    address = f"ipc://{os.path.join(tmp_path, 'in')}"
    return ctx, Receiver(ctx, address), Sender(ctx, address)


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_recv_all_drains_every_queued_message_in_order(tmp_path):
    ctx, receiver, sender = pair(tmp_path)
    try:
        assert receiver.recv_all(timeout_ms=10) == []
        for i in range(50):
            sender.send({"i": i})
        got = []
        while len(got) < 50:
            got += receiver.recv_all(timeout_ms=1000)
        assert got == [{"i": i} for i in range(50)]
        assert receiver.recv_all() == []
    finally:
        receiver.close(), sender.close(), ctx.term()


def test_thread_and_loop_take_turns_without_loss_or_reordering(tmp_path):
    ctx, receiver, sender = pair(tmp_path)
    reader = SocketReader(receiver)
    got: list[tuple[str, int]] = []
    stop = threading.Event()

    def thread_main() -> None:
        while not stop.is_set():
            reader.read_on_thread(20, lambda msg: got.append(("thread", msg)))

    thread = threading.Thread(target=thread_main, daemon=True)
    thread.start()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        for i in range(0, 20):
            sender.send(i)
        wait_until(lambda: len(got) >= 5)  # the thread is reading
        for i in range(20, 40):  # some still queued when the loop takes over
            sender.send(i)
        reader.move_to_loop(loop, lambda msg: got.append(("loop", msg)))
        assert reader.loop is loop
        for i in range(40, 60):
            sender.send(i)
            await asyncio.sleep(0)
        deadline = loop.time() + 5
        while len(got) < 60:
            assert loop.time() < deadline, got
            await asyncio.sleep(0.005)
        reader.move_to_thread()
        assert reader.loop is None
        for i in range(60, 70):
            sender.send(i)

    try:
        asyncio.run(scenario())
        wait_until(lambda: len(got) >= 70)
        assert [m for _, m in got] == list(range(70))
        readers = [who for who, _ in got]
        assert readers[:5] == ["thread"] * 5 and readers[-10:] == ["thread"] * 10
        assert [who for who, m in got if 40 <= m < 60] == ["loop"] * 20  # sent while the loop read
        # one switch to the loop and one back: nothing read by the thread while the loop had the socket
        switches = sum(1 for a, b in zip(readers, readers[1:], strict=False) if a != b)
        assert switches == 2
    finally:
        stop.set()
        thread.join(timeout=2)
        receiver.close(), sender.close(), ctx.term()


def send_with_bad_ones(sender: Sender) -> None:
    """0..4, where 1 makes the handler raise and a garbled message (a token output's tag, then junk) follows 2."""
    for i in range(5):
        sender.send(i)
        if i == 2:
            sender.socket.send(b"T\x00not a pickle")


def failing_on_one(got: list[int]):
    def handle(msg: int) -> None:
        if msg == 1:
            raise RuntimeError("bad message")
        got.append(msg)
    return handle


def test_bad_messages_do_not_stop_the_loop_reading(tmp_path):
    ctx, receiver, sender = pair(tmp_path)
    reader = SocketReader(receiver)
    got: list[int] = []

    async def scenario() -> None:
        reader.move_to_loop(asyncio.get_running_loop(), failing_on_one(got))
        send_with_bad_ones(sender)
        deadline = asyncio.get_running_loop().time() + 5
        while len(got) < 4:
            assert asyncio.get_running_loop().time() < deadline, got
            await asyncio.sleep(0.005)
        reader.move_to_thread()

    try:
        asyncio.run(scenario())
        assert got == [0, 2, 3, 4]
    finally:
        receiver.close(), sender.close(), ctx.term()


def test_bad_messages_do_not_stop_the_thread_reading(tmp_path):
    ctx, receiver, sender = pair(tmp_path)
    reader = SocketReader(receiver)
    got: list[int] = []
    try:
        send_with_bad_ones(sender)
        deadline = time.monotonic() + 5
        while len(got) < 4:
            assert time.monotonic() < deadline, got
            reader.read_on_thread(20, failing_on_one(got))
        assert got == [0, 2, 3, 4]
    finally:
        receiver.close(), sender.close(), ctx.term()
