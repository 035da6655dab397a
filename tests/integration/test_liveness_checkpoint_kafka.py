"""Liveness survives a restart from a checkpoint, against the real broker: a ``LiveIndex``
checkpoints (in the compacted checkpoint topic) after one instance closed and another went
silent, and the one restarted from it reports them closed and stale, on the messages' clock, as
before; ``kvevents index`` restores that liveness, tracks a close met while catching up, and
saves it again."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kafka_streams import produce
from kvevents.consumer import (
    CacheIndex,
    KafkaCheckpointStore,
    LiveIndex,
    load_checkpoint,
    restore,
    save_checkpoint,
)
from kvevents.consumer.liveness import CONTROL_HEADER, Heard
from test_route_live_kafka import heartbeat, produce_with_headers, stored_batch, wait_for

pytestmark = pytest.mark.kafka

INSTANCES = ("quiet", "closer", "chatty")


def blocks(index: CacheIndex) -> dict[str, int]:
    """Blocks held per instance."""
    held = dict.fromkeys(INSTANCES, 0)
    for key in index.workers():
        held[key.instance_id] += index.worker_stats(key).blocks
    return held


def seen(live: LiveIndex, at: float) -> dict[str, tuple[str, float, int]]:
    """Per instance at time ``at``: state, last heard, blocks its workers hold."""
    with live.lock:
        held = blocks(live.index)
        return {
            i: (live.liveness.state(i, at), live.liveness.instance(i, at).last_heard_s, held[i])
            for i in INSTANCES
        }


def test_a_restart_from_a_checkpoint_keeps_closed_instances_closed_and_silent_ones_stale(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    produce(kafka_bootstrap, kafka_topic, [stored_batch(i) for i in INSTANCES])
    produce_with_headers(kafka_bootstrap, kafka_topic, heartbeat("closer", 1), [(CONTROL_HEADER, b"close")])
    store_topic = f"ckpt-live-{uuid.uuid4().hex[:10]}"
    store = KafkaCheckpointStore(kafka_bootstrap, store_topic, name="router")
    store.create_topic()
    live = LiveIndex(kafka_bootstrap, kafka_topic, stale_after_s=2.0)
    live.start()
    with live:
        # the reader is consuming (its first fetch can take a while on a busy machine) ...
        wait_for(lambda: seen(live, time.time())["chatty"][2] == 3, 30.0, "the stored batches applied")
        last = heartbeat("chatty", 1)
        for sequence in range(1, 7):  # only "chatty" speaks: "quiet" goes silent past the TTL
            last = heartbeat("chatty", sequence)
            produce(kafka_bootstrap, kafka_topic, [last])
            time.sleep(0.5)
        # ... and has applied the last heartbeat (liveness runs on the messages' clock: the Kafka
        # timestamp, in ms, stamped when it was produced, after it was made)
        wait_for(
            lambda: seen(live, time.time())["chatty"][1] >= (last.created_at_us // 1000) / 1000,
            30.0,
            "chatty's last heartbeat applied",
        )
        live.stop()
        at = time.time()
        before = seen(live, at)
        assert {i: s[0] for i, s in before.items()} == {
            "quiet": "stale",
            "closer": "closed",
            "chatty": "live",
        }
        assert before["closer"][2] == 0 and before["quiet"][2] == before["chatty"][2] == 3
        checkpoint = live.checkpoint()
        store.save(checkpoint)
    assert checkpoint.liveness is not None and checkpoint.liveness["closer"].closed
    assert checkpoint.liveness["quiet"] == Heard(before["quiet"][1], False)

    restarted = LiveIndex(
        kafka_bootstrap, kafka_topic, checkpoint=store.load(topic=kafka_topic), stale_after_s=2.0
    )
    restarted.start()
    with restarted:
        assert restarted.liveness.state("quiet") == "stale"  # at once: silent since before the restart
        assert seen(restarted, at) == before
        with restarted.lock:
            assert restarted.not_routable(at) == live.not_routable(at)

    # the CLI: `index` restores the file's liveness, meets chatty's close while catching up, saves
    path, again = tmp_path / "live.ckpt", tmp_path / "again.ckpt"
    save_checkpoint(path, checkpoint)
    produce_with_headers(kafka_bootstrap, kafka_topic, heartbeat("chatty", 7), [(CONTROL_HEADER, b"close")])
    done = subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "index", "-b", kafka_bootstrap, "-t", kafka_topic,
         "--checkpoint", str(path), "--save-checkpoint", str(again), "-q"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    resaved = load_checkpoint(again, topic=kafka_topic)
    saved = resaved.liveness
    assert saved is not None
    assert blocks(resaved.index()) == {"quiet": 3, "closer": 0, "chatty": 0}  # closed: blocks gone
    assert saved["quiet"] == checkpoint.liveness["quiet"] and saved["closer"] == checkpoint.liveness["closer"]
    assert (
        saved["chatty"].closed and saved["chatty"].last_heard_s >= checkpoint.liveness["chatty"].last_heard_s
    )


def test_restore_carries_the_checkpoints_liveness_and_tracks_the_catch_up(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    produce(kafka_bootstrap, kafka_topic, [stored_batch(i) for i in INSTANCES])
    produce_with_headers(kafka_bootstrap, kafka_topic, heartbeat("closer", 1), [(CONTROL_HEADER, b"close")])
    live = LiveIndex(kafka_bootstrap, kafka_topic, stale_after_s=2.0)
    live.start()
    with live:
        live.stop()
        checkpoint = live.checkpoint()
    time.sleep(2.5)  # "quiet" (and everyone) silent past the TTL since the checkpoint
    produce(kafka_bootstrap, kafka_topic, [heartbeat("chatty", 1)])  # caught up by restore()
    restored = restore(checkpoint, kafka_bootstrap, stale_after_s=2.0)
    with restored.reader:
        assert restored.caught_up is not None and restored.caught_up.messages == 1
        liveness = restored.liveness
        assert liveness.saved()["closer"] == checkpoint.liveness["closer"]  # type: ignore[index]
        assert liveness.saved()["quiet"] == checkpoint.liveness["quiet"]  # type: ignore[index]
        states = {i: liveness.state(i) for i in INSTANCES}
        assert states == {"quiet": "stale", "closer": "closed", "chatty": "live"}
        assert blocks(restored.index) == {"quiet": 3, "closer": 0, "chatty": 3}
        assert {k.instance_id: s for k, s in restored.not_routable().items()} == {
            "quiet": "stale",
            "closer": "closed",
        }

        # reading on with restored.observe keeps liveness current: chatty closes, its workers leave
        produce_with_headers(
            kafka_bootstrap, kafka_topic, heartbeat("chatty", 2), [(CONTROL_HEADER, b"close")]
        )
        read = restored.reader.apply_to(
            restored.index, until_caught_up=False, timeout=20, max_messages=1, on_message=restored.observe
        )
        assert read.messages == 1
        assert liveness.state("chatty") == "closed" and blocks(restored.index)["chatty"] == 0

    plain = restore(checkpoint, kafka_bootstrap, catch_up=False)  # not caught up: the checkpoint's view
    with plain.reader:
        assert plain.caught_up is None and plain.liveness.saved() == checkpoint.liveness
