"""The coordinator's server-side settings: one place for their names, defaults
and limits. Values come from the model config's ``parameters`` (strings), with
``${VAR}`` expanded from the environment, and may be overridden by the
environment variables in ``ENV_OVERRIDES`` (how Kubernetes ConfigMaps set the
knobs without editing config.pbtxt)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from coordinator.engines.contract import SEED_INPUT_NAMES
from coordinator.drafters import registry
from coordinator.policy.speculation import PolicySettings

MAX_NGRAM = 16  # longest prompt lookup n-gram accepted

# Hard upper bound of the speculation window accepted anywhere; a TensorRT-LLM
# target engine must be built with --max_draft_len at least the configured window.
MAX_SPECULATION_WINDOW = 16

ENV_OVERRIDES = {
    "speculation_window": "SPECDEC_SPECULATION_WINDOW",
    "fallback_threshold": "SPECDEC_FALLBACK_THRESHOLD",
    "adaptive_window": "SPECDEC_ADAPTIVE_WINDOW",
    "draft_timeout_seconds": "SPECDEC_DRAFT_TIMEOUT_SECONDS",
    "drafter": "SPECDEC_DRAFTER",
    "max_inflight_requests": "SPECDEC_MAX_INFLIGHT",
    "speculation_ab_fraction": "SPECDEC_AB_FRACTION",
    "trace_file": "SPECDEC_TRACE_FILE",
}


class SettingsError(ValueError):
    """A server-side configuration value is missing or out of range."""


@dataclass(frozen=True)
class CoordinatorSettings:
    speculation_window: int = 8
    fallback_threshold: float = 0.3
    # Let the cost model pick the window (1..speculation_window) or plain
    # decoding each round; false drafts speculation_window tokens every round.
    adaptive_window: bool = True
    target_model_name: str = "target"
    draft_model_name: str = "draft"
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    max_context_tokens: int = 4096
    tokenizer_dir: str = ""
    # Deadline of one draft call (queueing included). A draft that answers later
    # is treated as failed for that request, which goes on with the target
    # alone; 0 waits forever.
    draft_timeout_seconds: float = 10.0
    # The engines' seed input: random_seed (tensorrtllm backend <= v0.19, the
    # CPU engine) or seed (newer backends, which ignore an undeclared name).
    engine_seed_input: str = "random_seed"
    # Whether the target and draft models are decoupled (model_transaction_policy):
    # then a call may stream its tokens back (a stretch of plain decoding in
    # one call) and is read as a stream of responses. TensorRT-LLM's model is
    # decoupled when its decoupled_mode is set; the CPU engine always is.
    engine_decoupled: bool = False
    # Whether the target takes the CPU engine's prompt_length input (the prompt's
    # length with every call: coordinator/engines/contract.py); TensorRT-LLM has none.
    engine_prompt_length: bool = False
    # Before it serves its first request, the coordinator times its engines
    # (coordinator/policy/startup_profile.py), so the first burst at a load is
    # priced by the batch forecast; false: the costs are learnt from requests.
    engine_profile: bool = True
    # Most tokens one streamed plain call may generate when the policy plans a
    # stretch of plain decoding (decoupled engines only; otherwise one per call).
    # Longer stretches save round trips; a client that cancels or hits a stop
    # word wastes at most this many tokens of target work.
    plain_stretch_tokens: int = 16
    # Who drafts when a request does not say (coordinator/drafters/):
    # draft_model, prompt_lookup (n-gram match over the prompt and the text so
    # far, no model) or hybrid (prompt lookup or the draft model, whichever is
    # predicted faster, where the last hybrid_min_match tokens occurred before;
    # the draft model elsewhere).
    drafter: str = "hybrid"
    # Longest and shortest n-gram prompt lookup matches (it tries the longest first).
    prompt_lookup_max_ngram: int = 3
    prompt_lookup_min_ngram: int = 1
    # A match this long means the text is copying (on held-out HumanEval code,
    # prompt lookup's next token was right ~60 % of the time after a 3-token
    # match, ~90 % after 8 or more; on copied code always): shorter ones are
    # left to the draft model.
    hybrid_min_match: int = 8
    # Whether requests with penalties, min_length or bad_words speculate. That
    # is lossless only if the target engine processes each verified position
    # with the drafted tokens before it, as plain decoding would: the CPU
    # engine does (tests/unit/test_penalties.py); on a TensorRT-LLM engine check it
    # first (docs/gpu.md). false: such requests decode with the target alone.
    speculate_with_penalties: bool = True
    # Admission control (coordinator/request/admission.py): the most requests
    # in flight at once; the next one is refused at once with an error
    # (UNAVAILABLE; 429 from the OpenAI frontend) instead of queueing behind
    # work the engines cannot take. Each profile's config sets it to the target
    # engine's capacity (its max_batch_size); a config without it gets the
    # trtllm profile's, 64. At least 1: a server that admits nobody is a mistake.
    max_inflight_requests: int = 64
    # The traffic split (docs/rollout.md): this share of requests, chosen by a
    # hash of their ab_key (the OpenAI user; random where none), decodes
    # without speculation (arm control), the rest with the server's defaults
    # (arm speculative). A request that sets speculation_window keeps it (arm
    # none). 0: no split.
    speculation_ab_fraction: float = 0.0
    # Per-request tracing (coordinator/triton/tracing.py): a file the spans are
    # appended to as JSON lines; "" writes none (OTLP is set by the standard
    # OTEL_EXPORTER_OTLP_ENDPOINT).
    trace_file: str = ""
    # The speculation policy's tuning values (coordinator/policy/speculation.py): set with
    # parameters of their own names (history_tokens, min_evidence, ...).
    policy: PolicySettings = field(default_factory=PolicySettings)

    def __post_init__(self) -> None:
        if not 0 <= self.speculation_window <= MAX_SPECULATION_WINDOW:
            raise SettingsError(
                f"speculation_window must be between 0 and {MAX_SPECULATION_WINDOW}, got {self.speculation_window}"
            )
        if not 0.0 <= self.fallback_threshold <= 1.0:
            raise SettingsError(f"fallback_threshold must be between 0 and 1, got {self.fallback_threshold}")
        if self.max_tokens_limit < 1:
            raise SettingsError(f"max_tokens_limit must be at least 1, got {self.max_tokens_limit}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise SettingsError(
                f"default_max_tokens must be between 1 and max_tokens_limit ({self.max_tokens_limit}), "
                f"got {self.default_max_tokens}"
            )
        if not (self.draft_timeout_seconds >= 0.0 and self.draft_timeout_seconds < float("inf")):
            raise SettingsError(
                f"draft_timeout_seconds must be a finite number >= 0 (0 = no deadline), got {self.draft_timeout_seconds}"
            )
        if self.engine_seed_input not in SEED_INPUT_NAMES:
            raise SettingsError(
                f"engine_seed_input must be one of {', '.join(SEED_INPUT_NAMES)}, got {self.engine_seed_input!r}"
            )
        if self.plain_stretch_tokens < 1:
            raise SettingsError(f"plain_stretch_tokens must be at least 1, got {self.plain_stretch_tokens}")
        if self.drafter not in registry.names():
            raise SettingsError(f"drafter must be one of {', '.join(registry.names())}, got {self.drafter!r}")
        if not 1 <= self.prompt_lookup_min_ngram <= self.prompt_lookup_max_ngram <= MAX_NGRAM:
            raise SettingsError(
                f"prompt_lookup_min_ngram and prompt_lookup_max_ngram must satisfy 1 <= min <= max <= {MAX_NGRAM}, "
                f"got {self.prompt_lookup_min_ngram} and {self.prompt_lookup_max_ngram}")
        if not 1 <= self.hybrid_min_match <= MAX_NGRAM:
            raise SettingsError(f"hybrid_min_match must be between 1 and {MAX_NGRAM}, got {self.hybrid_min_match}")
        if self.max_inflight_requests < 1:
            raise SettingsError(
                f"max_inflight_requests ({ENV_OVERRIDES['max_inflight_requests']}) must be at least 1 "
                f"(the most requests served at once), got {self.max_inflight_requests}")
        if not 0.0 <= self.speculation_ab_fraction <= 1.0:
            raise SettingsError(
                f"speculation_ab_fraction (SPECDEC_AB_FRACTION) must be between 0 and 1, "
                f"got {self.speculation_ab_fraction}")
        problems = self.policy.check()
        if problems:
            raise SettingsError("; ".join(problems))
        if self.max_context_tokens < 2:
            raise SettingsError(f"max_context_tokens must be at least 2, got {self.max_context_tokens}")

    @classmethod
    def from_parameters(
        cls, parameters: Mapping[str, str], environ: Mapping[str, str] | None = None
    ) -> CoordinatorSettings:
        """Build settings from Triton parameters; unknown keys are an error."""
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls) if f.name != "policy"}
        tuning = {f.name: f for f in fields(PolicySettings)}
        known.update(tuning)
        unknown = sorted(set(parameters) - set(known))
        if unknown:
            raise SettingsError(f"unknown coordinator parameter(s): {', '.join(unknown)}; known: {', '.join(known)}")
        raw = {k: expand_env(v, environ, k) for k, v in parameters.items()}
        for name, var in ENV_OVERRIDES.items():
            if environ.get(var, "").strip():
                raw[name] = environ[var].strip()
        values = {}
        for name, text in raw.items():
            kind = known[name].type
            try:
                values[name] = _convert(text, kind)
            except ValueError:
                raise SettingsError(f"coordinator parameter {name} must be {kind}, got {text!r}") from None
        policy = PolicySettings(**{k: values.pop(k) for k in list(values) if k in tuning})
        return cls(**values, policy=policy)


def _convert(text: str, kind: str):
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        if text.strip().lower() not in ("true", "false"):
            raise ValueError(text)
        return text.strip().lower() == "true"
    return text


_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: str, environ: Mapping[str, str], name: str) -> str:
    """Expand ``${VAR}`` references in a config parameter value."""

    def substitute(match: re.Match[str]) -> str:
        var = match.group(1)
        if var not in environ:
            raise SettingsError(f"parameter {name}={value!r} needs environment variable {var}, which is not set")
        return environ[var]

    return _ENV_REFERENCE.sub(substitute, value)
