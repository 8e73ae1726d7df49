"""What an engine call samples with: the settings (tensorrtllm names), the
context-dependent penalties, and the seed of each call.

Random state follows the tensorrtllm backend: every engine call is a new
request whose random numbers come from that call's seed alone, drawn in
order (TensorRT-LLM seeds curand once per request from ``random_seed``). The
coordinator therefore gives every call its own seed, derived from the
request's seed, the call's absolute position and its role (``call_seed``), so
no two calls of a request share a stream and the same request seed still
gives the same text.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace

ROLES = ("draft", "target")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings as the engines receive them (tensorrtllm names)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter; 1: greedy
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 0
    end_id: int | None = None  # the engine's end token (None: the model's own)
    penalties: Penalties | None = None  # context-dependent processing (coordinator/sampling/penalties.py)
    log_probs: bool = False  # the engine reports each generated token's log probability

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def call_seed(request_seed: int, position: int, role: str) -> int:
    """The seed of one engine call: a 64-bit hash of (request seed, absolute
    position of the call's first new token, role).

    Positions only grow within a request and each role makes one call per
    position, so every call of a request draws from a stream of its own."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    key = struct.pack("<QQ", int(request_seed) % 2**64, int(position)) + role.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"specdec-seed").digest(), "little")


@dataclass(frozen=True)
class Penalties:
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    min_length: int = 0  # generated tokens before the end token may be drawn
    bad_words: tuple[tuple[int, ...], ...] = ()
    prompt_length: int = 0  # where generation starts in the sequence min_length counts from

    @property
    def counts_tokens(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0

    @property
    def active(self) -> bool:
        return self.counts_tokens or self.min_length > 0 or bool(self.bad_words)

    def for_call(self, input_length: int) -> "Penalties":
        """What one engine call is sent: TensorRT-LLM counts min_length from the
        call's own input, so a call gets what the request still owes."""
        generated = input_length - self.prompt_length
        return replace(self, min_length=max(0, self.min_length - generated), prompt_length=input_length)


NO_PENALTIES = Penalties()
