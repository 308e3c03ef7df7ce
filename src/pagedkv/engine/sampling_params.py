"""`SamplingParams`: how to turn logits into tokens, and when to stop (vLLM's names);
`StructuredOutputsParams`: the grammar a request's output must follow."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pagedkv.kv_transfer.config import KV_TRANSFER_PARAM_KEYS

_GREEDY_EPS = 1e-5


class SamplingParamError(ValueError):
    """An invalid sampling parameter: ``param`` names it (a server's 400 names the field).
    Raised by `SamplingParams` and by the engine for checks that need the model (vocab)."""

    PREFIX = "invalid sampling parameter "

    def __init__(self, param: str, value: object, why: str) -> None:
        super().__init__(f"{self.PREFIX}{param}={value!r}: {why}")
        self.param = param


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one constraint on the output text.

    - ``json``: a JSON Schema (dict, or its JSON text); ``json_object=True``: any JSON object;
    - ``regex``: the whole output matches it; ``choice``: the output is one of these strings;
    - ``grammar``: a context-free grammar, GBNF/EBNF (``root ::= ...``, xgrammar's format) or
      Lark (``start: ...``, llguidance's).

    ``disable_any_whitespace`` makes JSON compact (no whitespace between tokens): small models
    otherwise tend to emit whitespace runs. ``backend`` overrides the engine's
    ``structured_outputs_backend`` for this request (``"xgrammar"`` or ``"guidance"``).
    The grammar itself is checked when the engine compiles it (`StructuredOutputManager`);
    here only the shape: invalid values raise `SamplingParamError` naming ``structured_outputs``.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    backend: str | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        def bad(why: str) -> SamplingParamError:
            set_fields = {
                k: getattr(self, k)
                for k in ("json", "regex", "choice", "grammar", "json_object", "backend")
                if getattr(self, k) is not None
            }
            return SamplingParamError("structured_outputs", _short(set_fields), why)

        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise bad(
                "exactly one of json, regex, choice, grammar and json_object must be set"
                f" (got {kinds or 'none'})"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise bad("json must be a JSON Schema (an object or its JSON text)")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise bad(f"json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise bad("json must be a JSON Schema (an object)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise bad("grammar must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise bad("choice must be a non-empty list of non-empty strings")
        if self.backend not in (None, "xgrammar", "guidance"):
            raise bad(f"backend must be 'xgrammar' or 'guidance', got {self.backend!r}")

    def key(self) -> tuple[str, str, bool]:
        """``(kind, spec, disable_any_whitespace)``: what a compiled grammar is cached by (a
        schema dict as compact JSON in its own key order: xgrammar emits properties in schema
        order, so two orders are two grammars)."""
        ws = bool(self.disable_any_whitespace)
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else _canonical_json(self.json)
            return "json", spec, ws
        if self.regex is not None:
            return "regex", self.regex, ws
        if self.choice is not None:
            return "choice", _canonical_json(self.choice), ws
        if self.grammar is not None:
            return "grammar", self.grammar, ws
        return "json_object", "", ws


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _canonical_json(x: Any) -> str:
    try:
        return json.dumps(x, separators=(",", ":"))
    except (TypeError, ValueError):
        return repr(x)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters.

    ``temperature == 0`` means greedy. ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable those filters. Penalties follow vLLM/OpenAI: ``repetition_penalty``
    (> 1 discourages tokens seen in the prompt or output, multiplicatively),
    ``presence_penalty`` / ``frequency_penalty`` (additive, over output tokens). ``seed`` makes
    one request's sampling reproducible whatever else is in the batch. ``stop`` strings are
    removed from the output text (unless ``include_stop_str_in_output``); ``stop_token_ids`` and
    EOS (unless ``ignore_eos``) end the request with reason ``"stop"``, ``max_tokens`` with
    ``"length"``. ``n`` completions share the prompt's KV blocks. ``logprobs=k`` returns the
    sampled token's logprob and the top-k alternatives per step. ``prompt_logprobs=k`` returns
    (in ``RequestOutput.prompt_logprobs``) each prompt token's logprob and rank plus the top-k
    at its position (None for the first token), from the raw model distribution; such a
    request never reads the prefix cache (vLLM's rule: cached positions have no logits).
    ``structured_outputs`` constrains the output to a grammar (JSON Schema, regex, choice,
    CFG): the sampler masks every token the grammar does not allow (logprobs stay the raw
    model's, as vLLM's), and the request ends when the grammar is complete.

    Invalid values raise ValueError naming the parameter; every float field must be finite
    (NaN and ±inf are refused: NaN passes every range comparison and poisons the sampler).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # KV connector options: max_offload_tokens, offload_policy ("BLOCK_LEVEL" |
    # "REQUEST_LEVEL"), skip_reading_prefix_cache (never read cached KV for this request).
    kv_transfer_params: dict | None = None
    # Token eviction for this request (`core.token_eviction`): {"policy": "streaming" |
    # "snapkv", "sink_tokens", "recent_tokens", "budget_tokens", ...}; None: the engine's.
    kv_eviction: dict | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _stop: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop = [self.stop]
        else:
            self._stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.verify()

    def verify(self) -> None:
        def bad(name: str, why: str) -> SamplingParamError:
            return SamplingParamError(name, getattr(self, name), why)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in _FLOAT_FIELDS:  # NaN slips through every range check below (nan < 0 is False)
            if not _is_finite_number(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must be <= max_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "must be non-negative integers")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.kv_eviction is not None:
            from pagedkv.core.token_eviction import KVEvictionConfig, KVEvictionError

            try:
                KVEvictionConfig.from_value(self.kv_eviction)
            except (KVEvictionError, TypeError) as e:
                raise bad("kv_eviction", str(e)) from None
        ktp = self.kv_transfer_params
        if ktp is not None:
            if not isinstance(ktp, dict):
                raise bad("kv_transfer_params", "must be a dict")
            unknown = set(ktp) - KV_TRANSFER_PARAM_KEYS
            if unknown:
                raise bad("kv_transfer_params", f"unknown keys {sorted(unknown)}")
            if ktp.get("offload_policy", "BLOCK_LEVEL") not in ("BLOCK_LEVEL", "REQUEST_LEVEL"):
                raise bad(
                    "kv_transfer_params", "offload_policy must be BLOCK_LEVEL or REQUEST_LEVEL"
                )
            mot = ktp.get("max_offload_tokens")
            if mot is not None and (not isinstance(mot, int) or mot < 0):
                raise bad("kv_transfer_params", "max_offload_tokens must be an integer >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


# Every float field: each must be a finite number (NaN and ±inf are refused, naming the field).
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def _is_finite_number(x: object) -> bool:
    """An int or float (not a bool) that is neither NaN nor ±inf."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
