"""A seeded, reproducible stream of LLM requests with realistic prefix sharing.

Shared system prompts, Zipf-popular documents, multi-turn conversations, Poisson arrivals,
optional LoRA adapters and retention ranges (knobs in :class:`WorkloadConfig`). ``content_seed``
fixes the shared content (the same on every worker), ``seed`` one request stream (see
:func:`derive_seed`); a request carries its deterministic answer (:func:`answer_tokens`).
The mix in detail: ``docs/SIMULATOR.md``.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .cache import RetentionRange, to_token_array

__all__ = [
    "HELD_OUT_REQUEST_ID_BASE",
    "Request",
    "WorkloadConfig",
    "WorkloadGenerator",
    "answer_tokens",
    "derive_seed",
    "random_tokens",
    "zipf_weights",
]

HELD_OUT_REQUEST_ID_BASE = 1 << 48
"""Request ids of held-out requests start here, apart from the stream's ids."""
_ANSWER_SALT = 0x616E73776572  # "answer"
_U32_MAX = (1 << 32) - 1


def derive_seed(*parts: object) -> int:
    """A 64-bit seed derived from any printable parts, e.g. ``derive_seed(seed, instance, rank)``."""
    return xxhash.xxh3_64_intdigest("\x1f".join(map(repr, parts)).encode())


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> array[int]:
    """``count`` uniform token ids in ``[0, vocab_size)``, as ``array('i')``."""
    raw = array("I", rng.randbytes(4 * count))
    return array("i", [t % vocab_size for t in raw])


def answer_tokens(prompt: array[int], lora_id: int | None, count: int, vocab_size: int) -> array[int]:
    """The deterministic answer to a prompt (same prompt and LoRA → same answer, any process).

    A longer answer extends a shorter one (``count`` only truncates), like greedy decoding.
    """
    data = to_token_array(prompt).tobytes()
    if lora_id is not None:
        data += struct.pack("<Q", lora_id)
    rng = random.Random(xxhash.xxh3_64_intdigest(data, seed=_ANSWER_SALT))
    return random_tokens(rng, count, vocab_size)


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Unnormalised Zipf weights ``1 / (k + 1) ** exponent`` for ranks ``0..n-1``."""
    return [1.0 / (k + 1) ** exponent for k in range(n)]


def _check_range(name: str, value: tuple[int, int], minimum: int) -> None:
    lo, hi = value
    if not (isinstance(lo, int) and isinstance(hi, int) and minimum <= lo <= hi):
        raise ValueError(f"{name} must be (low, high) ints with {minimum} <= low <= high, got {value!r}")


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within [0, 1], got {value!r}")


def _check_priority(name: str, value: int | None) -> None:
    if value is not None and not (isinstance(value, int) and 0 <= value <= 100):
        raise ValueError(f"{name} must be None or an int in 0..100, got {value!r}")


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that shapes a request stream. Token counts are (low, high), inclusive."""

    seed: int = 0
    """Seed of this request stream (one per rank)."""
    content_seed: int = 0
    """Seed of the shared content (system prompts, documents): the same on every worker."""
    vocab_size: int = 32_000
    request_rate: float = 10.0
    """Mean requests per simulated second (Poisson arrivals)."""
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (256, 1024)
    num_documents: int = 128
    document_tokens: tuple[int, int] = (256, 1536)
    zipf_exponent: float = 1.1
    document_probability: float = 0.5
    """Probability that a new conversation starts with a document after the system prompt."""
    user_tokens: tuple[int, int] = (16, 192)
    output_tokens: tuple[int, int] = (16, 192)
    follow_up_probability: float = 0.6
    """Probability that a request is the next turn of an ongoing conversation (if one is ready)."""
    follow_up_delay_s: float = 2.0
    """A conversation's next turn comes at least this long (simulated) after its previous one."""
    max_turns: int = 6
    max_active_conversations: int = 32
    max_prompt_tokens: int = 6144
    """A conversation ends when its next prompt could exceed this."""
    lora_ids: tuple[int, ...] = ()
    lora_probability: float = 0.0
    """Probability that a new conversation uses one of ``lora_ids`` (drawn uniformly)."""
    system_prompt_priority: int | None = 80
    document_priority: int | None = None
    conversation_priority: int | None = 50
    """Retention priority a follow-up turn asks for its conversation's history (None: none)."""

    def __post_init__(self) -> None:
        if not 2 <= self.vocab_size <= (1 << 31) - 1:
            raise ValueError(f"vocab_size must be within 2..2**31-1, got {self.vocab_size}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests per second, got {self.request_rate}")
        if self.num_system_prompts < 1:
            raise ValueError(f"num_system_prompts must be >= 1, got {self.num_system_prompts}")
        if self.num_documents < 0:
            raise ValueError(f"num_documents must be >= 0, got {self.num_documents}")
        _check_range("system_prompt_tokens", self.system_prompt_tokens, 0)
        _check_range("document_tokens", self.document_tokens, 1)
        _check_range("user_tokens", self.user_tokens, 1)
        _check_range("output_tokens", self.output_tokens, 1)
        for name in ("document_probability", "follow_up_probability", "lora_probability"):
            _check_probability(name, getattr(self, name))
        for name in ("system_prompt_priority", "document_priority", "conversation_priority"):
            _check_priority(name, getattr(self, name))
        if self.zipf_exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {self.zipf_exponent}")
        if self.max_turns < 1 or self.max_active_conversations < 1:
            raise ValueError("max_turns and max_active_conversations must be >= 1")
        if self.follow_up_delay_s < 0:
            raise ValueError(f"follow_up_delay_s must be >= 0, got {self.follow_up_delay_s}")
        if self.lora_probability > 0 and not self.lora_ids:
            raise ValueError("lora_probability > 0 needs lora_ids")
        first_turn = self.system_prompt_tokens[1] + self.user_tokens[1]
        if self.num_documents and self.document_probability > 0:
            first_turn += self.document_tokens[1]
        if first_turn > self.max_prompt_tokens:
            raise ValueError(
                f"max_prompt_tokens={self.max_prompt_tokens} is below the longest first turn ({first_turn} tokens)"
            )

    def for_worker(self, instance_id: str, attention_dp_rank: int | None) -> WorkloadConfig:
        """This workload for one worker: the same shared content, a request stream of its own
        (``seed`` derived from this config's seed, the instance id and the rank)."""
        return dataclasses.replace(self, seed=derive_seed(self.seed, instance_id, attention_dp_rank))

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + output a request of this workload can have."""
        return self.max_prompt_tokens + self.output_tokens[1]


@dataclass(frozen=True, eq=False)
class Request:
    """One inference request: its prompt, the answer the engine will produce, and metadata."""

    request_id: int
    prompt: array[int]
    output: array[int]
    """The tokens the engine generates (``len(output)`` is the request's max_new_tokens)."""
    arrival_time: float = 0.0
    lora_id: int | None = None
    retention: tuple[RetentionRange, ...] = ()
    conversation_id: int | None = None
    turn: int = 0
    system_prompt: int | None = None
    document: int | None = None

    @property
    def max_new_tokens(self) -> int:
        return len(self.output)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (token ids as lists)."""
        return {
            "request_id": self.request_id,
            "prompt": self.prompt.tolist(),
            "output": self.output.tolist(),
            "arrival_time": self.arrival_time,
            "lora_id": self.lora_id,
            "retention": [list(r) for r in self.retention],
            "conversation_id": self.conversation_id,
            "turn": self.turn,
            "system_prompt": self.system_prompt,
            "document": self.document,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Request:
        """The inverse of :meth:`to_json`; missing optional fields take their defaults."""
        try:
            return cls(
                request_id=int(data["request_id"]),
                prompt=to_token_array(data["prompt"]),
                output=to_token_array(data["output"]),
                arrival_time=float(data.get("arrival_time", 0.0)),
                lora_id=data.get("lora_id"),
                retention=tuple(RetentionRange(*r) for r in data.get("retention", ())),
                conversation_id=data.get("conversation_id"),
                turn=int(data.get("turn", 0)),
                system_prompt=data.get("system_prompt"),
                document=data.get("document"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a request: {exc!r}") from None


@dataclass
class _Conversation:
    conversation_id: int
    history: array[int]
    """The last turn's prompt + answer: what the next turn extends."""
    lora_id: int | None
    system_prompt: int
    system_len: int
    document: int | None
    document_end: int
    turns: int
    last_arrival: float


@dataclass
class _StreamState:
    clock: float = 0.0
    next_request_id: int = 0
    next_conversation_id: int = 0
    active: dict[int, _Conversation] = field(default_factory=dict)


class WorkloadGenerator:
    """An endless, reproducible iterator of :class:`Request` (same config → same stream)."""

    def __init__(self, config: WorkloadConfig | None = None) -> None:
        self.config = config or WorkloadConfig()
        cfg = self.config
        self._rng = random.Random(derive_seed("stream", cfg.seed))
        self._state = _StreamState()
        self._system_prompts = [
            self._content("system", i, cfg.system_prompt_tokens) for i in range(cfg.num_system_prompts)
        ]
        self._documents: dict[int, array[int]] = {}
        self._doc_cum_weights = list(itertools.accumulate(zipf_weights(cfg.num_documents, cfg.zipf_exponent)))

    # ------------------------------------------------------------------ content

    def _content(self, kind: str, index: int, length: tuple[int, int]) -> array[int]:
        rng = random.Random(derive_seed("content", self.config.content_seed, kind, index))
        return random_tokens(rng, rng.randint(*length), self.config.vocab_size)

    def system_prompt(self, index: int) -> array[int]:
        """The shared system prompt ``index`` (same tokens on every worker)."""
        return self._system_prompts[index]

    def document(self, index: int) -> array[int]:
        """Document ``index`` (popularity rank; 0 is the most popular)."""
        doc = self._documents.get(index)
        if doc is None:
            if not 0 <= index < self.config.num_documents:
                raise IndexError(f"document {index} out of range 0..{self.config.num_documents - 1}")
            doc = self._documents[index] = self._content("document", index, self.config.document_tokens)
        return doc

    # ------------------------------------------------------------------ requests

    def __iter__(self) -> Iterator[Request]:
        return self

    def __next__(self) -> Request:
        return self.next_request()

    @property
    def clock(self) -> float:
        """Arrival time of the last request drawn (simulated seconds)."""
        return self._state.clock

    @property
    def active_conversations(self) -> int:
        return len(self._state.active)

    def next_request(self) -> Request:
        """Draw the next request of the stream (arrival times increase)."""
        cfg = self.config
        rng = self._rng
        state = self._state
        state.clock += rng.expovariate(cfg.request_rate)
        ready = [c for c in state.active.values() if state.clock - c.last_arrival >= cfg.follow_up_delay_s]
        if ready and rng.random() < cfg.follow_up_probability:
            conv = rng.choice(ready)
            request = self._follow_up(rng, conv, state.next_request_id, state.clock)
        else:
            conv = self._new_conversation(rng, state.next_conversation_id)
            state.next_conversation_id += 1
            request = self._first_turn(rng, conv, state.next_request_id, state.clock)
            while len(state.active) >= cfg.max_active_conversations:
                del state.active[next(iter(state.active))]
            state.active[conv.conversation_id] = conv
        state.next_request_id += 1
        conv.history = request.prompt + request.output
        conv.turns += 1
        conv.last_arrival = state.clock
        if conv.turns >= cfg.max_turns or len(conv.history) + cfg.user_tokens[1] > cfg.max_prompt_tokens:
            state.active.pop(conv.conversation_id, None)
        return request

    def take(self, count: int) -> list[Request]:
        """The next ``count`` requests of the stream."""
        return [self.next_request() for _ in range(count)]

    def held_out(self, count: int, seed: int = 0) -> list[Request]:
        """``count`` requests from the same distribution, for routing evaluation.

        They do not advance this stream: follow-ups continue this stream's ongoing
        conversations (so the worker that served those turns holds their prefix), the others
        start new conversations over the shared system prompts and Zipf documents. Arrival times
        are 0; request ids start at :data:`HELD_OUT_REQUEST_ID_BASE`.
        """
        cfg = self.config
        rng = random.Random(derive_seed("held-out", cfg.seed, seed))
        active = list(self._state.active.values())
        requests = []
        for i in range(count):
            request_id = HELD_OUT_REQUEST_ID_BASE + i
            if active and rng.random() < cfg.follow_up_probability:
                requests.append(self._follow_up(rng, rng.choice(active), request_id, 0.0))
            else:
                conv = self._new_conversation(rng, HELD_OUT_REQUEST_ID_BASE + i)
                requests.append(self._first_turn(rng, conv, request_id, 0.0))
        return requests

    # ------------------------------------------------------------------ internals

    def _new_conversation(self, rng: random.Random, conversation_id: int) -> _Conversation:
        cfg = self.config
        lora_id = rng.choice(cfg.lora_ids) if cfg.lora_ids and rng.random() < cfg.lora_probability else None
        system = rng.randrange(cfg.num_system_prompts)
        document = None
        if cfg.num_documents and rng.random() < cfg.document_probability:
            document = bisect.bisect_left(self._doc_cum_weights, rng.random() * self._doc_cum_weights[-1])
            document = min(document, cfg.num_documents - 1)
        system_len = len(self._system_prompts[system])
        doc_len = 0 if document is None else len(self.document(document))
        return _Conversation(
            conversation_id=conversation_id,
            history=array("i"),
            lora_id=lora_id,
            system_prompt=system,
            system_len=system_len,
            document=document,
            document_end=system_len + doc_len,
            turns=0,
            last_arrival=0.0,
        )

    def _retention(self, conv: _Conversation, history_end: int) -> tuple[RetentionRange, ...]:
        cfg = self.config
        ranges = []
        if cfg.system_prompt_priority is not None and conv.system_len:
            ranges.append(RetentionRange(0, conv.system_len, cfg.system_prompt_priority))
        if cfg.document_priority is not None and conv.document is not None:
            ranges.append(RetentionRange(conv.system_len, conv.document_end, cfg.document_priority))
        if cfg.conversation_priority is not None and history_end > conv.system_len:
            ranges.append(RetentionRange(conv.system_len, history_end, cfg.conversation_priority))
        return tuple(ranges)

    def _finish(
        self,
        rng: random.Random,
        conv: _Conversation,
        prompt: array[int],
        request_id: int,
        arrival: float,
        turn: int,
    ) -> Request:
        cfg = self.config
        output = answer_tokens(prompt, conv.lora_id, rng.randint(*cfg.output_tokens), cfg.vocab_size)
        history_end = len(conv.history) if turn > 0 else 0
        return Request(
            request_id=request_id,
            prompt=prompt,
            output=output,
            arrival_time=arrival,
            lora_id=conv.lora_id,
            retention=self._retention(conv, history_end),
            conversation_id=conv.conversation_id,
            turn=turn,
            system_prompt=conv.system_prompt,
            document=conv.document,
        )

    def _first_turn(
        self, rng: random.Random, conv: _Conversation, request_id: int, arrival: float
    ) -> Request:
        cfg = self.config
        prompt = array("i", self._system_prompts[conv.system_prompt])
        if conv.document is not None:
            prompt += self.document(conv.document)
        prompt += random_tokens(rng, rng.randint(*cfg.user_tokens), cfg.vocab_size)
        return self._finish(rng, conv, prompt, request_id, arrival, 0)

    def _follow_up(self, rng: random.Random, conv: _Conversation, request_id: int, arrival: float) -> Request:
        cfg = self.config
        prompt = conv.history + random_tokens(rng, rng.randint(*cfg.user_tokens), cfg.vocab_size)
        return self._finish(rng, conv, prompt, request_id, arrival, conv.turns)
