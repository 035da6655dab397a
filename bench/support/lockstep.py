"""The baseline of ``bench/gather.py``: TensorRT-LLM's attention-DP exchange, ported line by line.

``KVCacheEventManager::exchangeAttentionDpThread`` (``/work/shared/seed/kvCacheEventManager.cpp``)
runs, every ``attention_dp_events_gather_period_ms``:

1. a blocking ``allreduce(SUM)`` of "am I finished" over the ranks; any finished rank ends the
   loop on every rank;
2. on a rank != 0: take every buffered event, serialize, blocking ``send`` of the size
   (``uint64``, tag ``kKvCacheEventSize``), then, if there were events, blocking ``send`` of the
   bytes (tag ``kKvCacheEvent``);
3. on rank 0: for rank 1..n-1 in turn, blocking ``recv`` of the size, then of the bytes,
   deserialize, append to its buffer;
4. sleep the period.

Same communicator split, same codec (Avro ``EventBatch``, the rank's drop count included, which
the C++ lacks), same buffer and manager as kvevents' gather: only the exchange differs. MPICH's
blocking calls busy-poll while they wait, as they do under the C++.
"""

from __future__ import annotations

import threading
import time
from array import array
from typing import Any

from kvevents.producer import EventBuffer, KVCacheEventManager
from kvevents.producer._mpi import import_mpi, split_gather_communicator
from kvevents.schemas import EventBatch, decode_batch, encode_batch

TAG_SIZE = 11  # mpi::MpiTag::kKvCacheEventSize
TAG_EVENTS = 12  # mpi::MpiTag::kKvCacheEvent


class LockstepExchange:
    """The C++ exchange thread, with the interface the manager expects of its gather."""

    def __init__(self, buffer: EventBuffer, rank: int, size: int, period_ms: float, comm: Any = None) -> None:
        self._mpi = mpi = import_mpi()
        self._comm = split_gather_communicator(mpi, mpi.COMM_WORLD if comm is None else comm, rank, size)
        self._buffer = buffer
        self._rank = rank
        self._size = size
        self._period_s = period_ms / 1000.0
        self._run = True  # mRun
        self.messages = 0
        self._thread = threading.Thread(target=self._exchange, name=f"lockstep-exchange-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        self._run = False

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float | None = None) -> bool:
        # ~KVCacheEventManager: mRun = false; mExchangeAttentionDpThread.join().
        self._run = False
        return self.join(timeout)

    def _exchange(self) -> None:
        mpi, comm, buffer = self._mpi, self._comm, self._buffer
        finished = array("i", [0])
        num_finished = array("i", [0])
        vec_size = array("Q", [0])
        while True:
            finished[0] = 0 if self._run else 1
            comm.Allreduce([finished, mpi.INT], [num_finished, mpi.INT], op=mpi.SUM)
            if num_finished[0] > 0:
                break  # "One of the rank has been shut down, exiting"
            if self._rank != 0:
                drain = buffer.drain(timeout=0)
                data = b""
                if drain.events or drain.dropped:
                    data = encode_batch(
                        EventBatch(
                            f"rank-{self._rank}",
                            drain.events,
                            attention_dp_size=self._size,
                            dropped=drain.dropped,
                        )
                    )
                vec_size[0] = len(data)
                comm.Send([vec_size, mpi.UINT64_T], 0, TAG_SIZE)
                if data:
                    comm.Send([data, mpi.BYTE], 0, TAG_EVENTS)
                    self.messages += 1
            else:
                for rank in range(1, self._size):
                    comm.Recv([vec_size, mpi.UINT64_T], rank, TAG_SIZE)
                    if vec_size[0]:
                        data = bytearray(vec_size[0])
                        comm.Recv([data, mpi.BYTE], rank, TAG_EVENTS)
                        batch = decode_batch(data)
                        for drops in batch.dropped:
                            buffer.record_drops(rank, drops.dropped_events)
                        buffer.extend(batch.events)
                        self.messages += 1
            time.sleep(self._period_s)


class LockstepManager(KVCacheEventManager):
    """``KVCacheEventManager`` whose attention-DP gather is :class:`LockstepExchange`."""

    def _make_gather(self, comm: Any, config: Any) -> Any:
        assert self._rank is not None and self._size is not None
        return LockstepExchange(self._buffer, self._rank, self._size, self._gather_period_ms, comm)
