"""A process of virtual GPU slots: `python -m bench.simulate.fleet CONFIG.json`.

Each virtual slot is a thread that does what a slot's worker process does, through the same code: it
consumes its class's real queue with prefetch 1 (kombu, the broker's transport options), runs each
message through Celery's own tracer (`celery.app.trace`), so that `run_shard` / `run_shards` execute as
in a worker (lease, commit marker, output in storage, result stored, the chord's `shard_done` callback
sent by the result backend), then acknowledges it. Only the model is the simulated one
(`bench.simulate.gpu_model`). A heartbeat thread writes every live slot's beat, in the shape and under the
keys real slots use. Free of Django: a GPU host has none.

Faults, at times the config gives (seconds from the shared start):
- `vanish`: the slot dies mid-shard: its message is neither acknowledged nor given back (the broker
  restores it after the visibility timeout), its beat stops; it comes back as a new worker later;
- `slow`: the slot runs `slowness` times slower from then on;
- `drain`: the class's slots are drained for maintenance (the draining mark, as `slot_drain` sets it; they
  finish their shard and take no other) and come back after `duration_s`;
- `broker_loss`: a host's slots lose the broker: their running shards stop unacknowledged, as Celery
  cancels long-running tasks on connection loss; they reconnect after `duration_s`.

Each message a slot took is one JSON line in the events file: the slot, the task, its shards, when it
was received and when it was acknowledged (or abandoned).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery.app.trace import trace_task
from kombu import Consumer, Exchange, Queue
from kombu.message import Message

from bench.simulate.gpu_model import SlotVanished, slot_context
from tasks.shared.config import HEARTBEAT_INTERVAL_S, WAVE_TASK
from tasks.shared.fleet import DRAINING_TTL_S, draining_key, heartbeat_key
from tasks.shared.redis_client import redis_client
from tasks.slot import run_shard  # noqa: F401  (registers the shard tasks, as a slot's worker imports them)
from tasks.slot.app import app
from tasks.slot.heartbeat import heartbeat_clear_commands, heartbeat_commands

logger = logging.getLogger("bench.simulate.fleet")

_stopping = threading.Event()


@dataclass
class VirtualSlot:
    host: str
    slot: str
    gpu_class: str
    queue: str
    generation: int = 0
    """How many times the slot came back (after vanishing or losing its broker): its worker name changes."""
    slowness: float = 1.0
    away_until: float = 0.0
    """The slot takes no message before this time (drained, gone, cut from its broker)."""
    gone: threading.Event = field(default_factory=threading.Event)
    draining: bool = False
    current_shard: str | None = None

    @property
    def worker(self) -> str:
        return f"sim{self.slot}-{self.generation}@{self.host}"

    @property
    def key(self) -> str:
        return heartbeat_key(self.host, self.slot, gpu_class=self.gpu_class, devices=self.slot)

    def beat(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "slot": self.slot,
            "gpu_class": self.gpu_class,
            "gpus": [int(self.slot)],
            "pid": os.getpid(),
            "worker": self.worker,
            "queue": self.queue,
            "loaded_models": [],
            "current_shard": self.current_shard,
            "telemetry": {},
            "at": time.time(),
        }


class EventLog:
    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, event: dict[str, Any]) -> None:
        line = json.dumps(event)
        with self._lock:
            self._file.write(line + "\n")


def _shards_of(task: str, args: list[Any]) -> list[list[Any]]:
    if task == WAVE_TASK:
        return [[spec["job_id"], spec["shard_index"]] for _, spec, _ in args[0]]
    return [[args[0]["job_id"], args[0]["shard_index"]]]


class SlotRunner:
    """One virtual slot's thread: consume, run, acknowledge, until the process stops."""

    def __init__(self, slot: VirtualSlot, events: EventLog) -> None:
        self.slot = slot
        self.events = events

    def run(self) -> None:
        slot_context.gone = self.slot.gone
        while not _stopping.is_set():
            if time.time() < self.slot.away_until or self.slot.draining:
                _stopping.wait(0.2)
                continue
            slot_context.slowness = self.slot.slowness
            try:
                self._consume()
            except Exception:
                logger.exception("virtual slot %s: consumer failed; reconnecting", self.slot.worker)
                _stopping.wait(1.0)

    def _consume(self) -> None:
        queue = Queue(self.slot.queue, Exchange(self.slot.queue), routing_key=self.slot.queue)
        connection = app.connection_for_read()
        channel = connection.channel()
        consumer = Consumer(channel, [queue], callbacks=[self._on_message], accept=["json"], prefetch_count=1)
        consumer.consume()
        try:
            while not _stopping.is_set() and not self.slot.gone.is_set() and not self.slot.draining:
                try:
                    connection.drain_events(timeout=1.0)
                except TimeoutError:
                    continue
        except SlotVanished:
            pass
        finally:
            if self.slot.gone.is_set():
                # A dead process gives nothing back: the message stays unacknowledged until the broker's
                # visibility timeout restores it.
                channel.do_restore = False  # type: ignore[attr-defined]
                self.slot.gone.clear()
            connection.release()

    def _on_message(self, body: Any, message: Message) -> None:
        headers = message.headers
        args, kwargs, embed = body
        task_name = headers["task"]
        received = time.time()
        shards = _shards_of(task_name, args)
        self.slot.current_shard = "/".join(map(str, shards[0]))
        request = {
            **headers,
            "delivery_info": message.delivery_info,
            "reply_to": message.properties.get("reply_to"),
            "correlation_id": message.properties.get("correlation_id", headers["id"]),
            "args": args,
            "kwargs": kwargs,
            "hostname": self.slot.worker,
            "is_eager": False,
            **(embed or {}),
        }
        outcome = "acked"
        try:
            trace_task(app.tasks[task_name], headers["id"], args, kwargs, request, app=app)
            message.ack()
        except SlotVanished:
            outcome = "abandoned"
            raise
        finally:
            self.slot.current_shard = None
            self.events.write(
                {
                    "slot": self.slot.key,
                    "worker": self.slot.worker,
                    "gpu_class": self.slot.gpu_class,
                    "task": task_name,
                    "task_id": headers["id"],
                    "shards": shards,
                    "received": received,
                    "ended": time.time(),
                    "outcome": outcome,
                }
            )


class Heartbeats:
    """Every present slot's beat, written each interval in one pipeline; a slot away has none."""

    def __init__(self, slots: list[VirtualSlot]) -> None:
        self.slots = slots

    def run(self) -> None:
        while not _stopping.is_set():
            now = time.time()
            try:
                pipe = redis_client().pipeline(transaction=False)
                for slot in self.slots:
                    if now < slot.away_until:
                        continue
                    heartbeat_commands(pipe, slot.key, slot.beat())
                pipe.execute()
            except Exception:
                logger.exception("heartbeats not sent")
            _stopping.wait(HEARTBEAT_INTERVAL_S)

    def remove(self) -> None:
        pipe = redis_client().pipeline(transaction=False)
        for slot in self.slots:
            heartbeat_clear_commands(pipe, slot.key)
        pipe.execute()


def _apply(fault: dict[str, Any], slots: dict[str, VirtualSlot], events: EventLog) -> None:
    kind, targets = fault["kind"], [slots[key] for key in fault["slots"] if key in slots]
    now = time.time()
    events.write(
        {
            "fault": kind,
            "workers": [slot.worker for slot in targets],
            "at": now,
            "until": now + float(fault.get("duration_s", 0)),
        }
    )
    for slot in targets:
        if kind == "slow":
            slot.slowness = float(fault["slowness"])
        elif kind in ("vanish", "broker_loss"):
            # Its beat stops and expires, as a dead process's does.
            slot.away_until = now + float(fault["duration_s"])
            slot.generation += 1
            slot.gone.set()
        elif kind == "drain":
            slot.draining = True
            redis_client().set(draining_key(slot.worker), "1", ex=DRAINING_TTL_S)
    if kind == "drain":
        threading.Timer(float(fault["duration_s"]), _undrain, args=(targets,)).start()


def _undrain(slots: list[VirtualSlot]) -> None:
    for slot in slots:
        # A drained worker is restarted to take work again; the restart clears its mark.
        redis_client().delete(draining_key(slot.worker))
        slot.draining = False


def _run_faults(faults: list[dict[str, Any]], start: float, slots: dict[str, VirtualSlot], events: EventLog) -> None:
    for fault in sorted(faults, key=lambda f: f["at_s"]):
        if _stopping.wait(max(0.0, start + fault["at_s"] - time.time())):
            return
        _apply(fault, slots, events)


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    slots = [VirtualSlot(**slot) for slot in config["slots"]]
    by_key = {slot.key: slot for slot in slots}
    events = EventLog(Path(config["events_path"]))
    signal.signal(signal.SIGTERM, lambda *_: _stopping.set())
    heartbeats = Heartbeats(slots)
    threads = [threading.Thread(target=heartbeats.run, name="heartbeats", daemon=True)]
    threads += [
        threading.Thread(target=SlotRunner(slot, events).run, name=f"slot {slot.key}", daemon=True) for slot in slots
    ]
    threads.append(
        threading.Thread(
            target=_run_faults, args=(config["faults"], config["start"], by_key, events), name="faults", daemon=True
        )
    )
    for thread in threads:
        thread.start()
    _stopping.wait()
    for thread in threads[1:-1]:
        thread.join(timeout=30)
    heartbeats.remove()
    socket.setdefaulttimeout(1)


if __name__ == "__main__":
    main(sys.argv[1])
