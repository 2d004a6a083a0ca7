"""A generation backend for OpenAI-compatible chat APIs (``ragen eval openai:MODEL ENV``).

Chat APIs take messages, not token ids, so this backend sets ``wants_messages = True`` and
the rollout passes each episode's chat messages along with its (unused) token prompt. Each
message list becomes one ``POST {OPENAI_BASE_URL}/chat/completions`` request; requests run
concurrently on a few threads, and transient failures (HTTP 429, 5xx, connection errors)
are retried with exponential backoff a bounded number of times. Only the standard library
is used.

The reply *text* is what matters; it is turned into token ids with a local tokenizer (the
embedded model's) only for bookkeeping (response lengths, the trajectory record). The
rollout decodes those ids back to text, so they are encoded with
``split_special_tokens=True``: a reply that happens to contain ``<|im_end|>`` stays text and
the round trip is exact (checked on every reply; a mismatch is warned about once).

Differences from a local model:

* ``response_prefix`` cannot be prefilled on a chat API; ``ragen eval`` clears it for API
  models (the prompt still asks for ``<answer>…</answer>``).
* The API drops the matched stop string from the reply; with exactly one stop string
  (ragen's ``</answer>``) it is put back when the API reports ``finish_reason == "stop"``
  and the reply does not already end with it. Replies are also cut locally after the first
  stop string, for servers that ignore ``stop``.
* ``top_k`` is not part of the OpenAI API and is not sent; greedy decoding
  (``do_sample=False``) is sent as ``temperature=0``.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ragen.engines.base import Generation, SamplingParams

DEFAULT_BASE_URL = "https://api.openai.com/v1"
#: HTTP statuses worth retrying: rate limits and server-side failures.
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


class OpenAIError(RuntimeError):
    """The API could not be used (bad configuration, or a request failed for good)."""


class OpenAIConfigError(OpenAIError, ValueError):
    """A user mistake: e.g. no ``OPENAI_API_KEY`` for the default (real) endpoint."""


def _local_tokenizer():
    from transformers import AutoTokenizer

    from ragen.models.embedded import embedded_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class OpenAIChatBackend:
    """``generate(prompts, params, messages=...)`` against ``{base_url}/chat/completions``.

    ``base_url`` and ``api_key`` default to ``$OPENAI_BASE_URL`` (else the OpenAI API) and
    ``$OPENAI_API_KEY``. A key is required only for the default endpoint; local servers
    (vLLM, llama.cpp, Ollama, ...) usually need none.
    """

    wants_messages = True

    def __init__(
        self,
        model: str,
        tokenizer=None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_workers: int = 4,
        max_retries: int = 4,
        backoff_s: float = 1.0,
        timeout_s: float = 120.0,
    ):
        if not model:
            raise OpenAIConfigError("openai: empty model name (use openai:MODEL, e.g. openai:gpt-4o-mini)")
        self.model = model
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        if not self.api_key and self.base_url == DEFAULT_BASE_URL:
            raise OpenAIConfigError(
                f"openai:{model} needs OPENAI_API_KEY (or set OPENAI_BASE_URL to an OpenAI-compatible server)"
            )
        self.max_workers = max(1, int(max_workers))
        self.max_retries = max(0, int(max_retries))
        self.backoff_s = float(backoff_s)
        self.timeout_s = float(timeout_s)
        self.tokenizer = tokenizer if tokenizer is not None else _local_tokenizer()
        self.pad_id = self.tokenizer.pad_token_id
        self.requests_sent = 0
        self._warned_roundtrip = False

    # -- the backend interface -----------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, messages: list[list[dict]] | None = None) -> list[Generation]:
        if messages is None or len(messages) != len(prompts):
            raise OpenAIError("OpenAIChatBackend.generate needs one chat message list per prompt (messages=...)")
        if not messages:
            return []
        body = self.request_body(params)
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(messages))) as pool:
            replies = list(pool.map(lambda m: self._complete({**body, "messages": m}), messages))
        return [self._to_generation(text, reason, params) for text, reason in replies]

    def request_body(self, params: SamplingParams) -> dict[str, Any]:
        """The sampling part of every request (``messages`` is added per episode)."""
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": float(params.temperature) if params.do_sample else 0.0,
            "top_p": float(params.top_p) if params.do_sample else 1.0,
            "max_tokens": int(params.max_new_tokens),
        }
        if params.stop:
            body["stop"] = list(params.stop)[:4]  # the OpenAI API accepts at most 4
        if params.min_new_tokens:
            body["min_tokens"] = int(params.min_new_tokens)  # vLLM's server extension; OpenAI itself rejects it
        return body

    # -- one request -----------------------------------------------------------------------

    def _complete(self, body: dict[str, Any]) -> tuple[str, str]:
        """POST one chat completion (with retries); return (reply text, API finish_reason)."""
        url = f"{self.base_url}/chat/completions"
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            request = urllib.request.Request(url, data=data, headers=headers, method="POST")
            try:
                self.requests_sent += 1
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    payload = json.loads(response.read().decode("utf-8"))
                return self._parse(payload, url)
            except urllib.error.HTTPError as exc:
                detail = _error_detail(exc)
                if exc.code not in RETRY_STATUSES or last:
                    raise OpenAIError(f"openai: HTTP {exc.code} from {url}: {detail}") from None
                self._sleep(attempt, exc.headers.get("Retry-After") if exc.headers else None)
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if last:
                    reason = getattr(exc, "reason", exc)
                    raise OpenAIError(f"openai: cannot reach {url}: {reason}") from None
                self._sleep(attempt, None)
            except json.JSONDecodeError as exc:
                raise OpenAIError(f"openai: {url} did not answer JSON: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _sleep(self, attempt: int, retry_after: str | None) -> None:
        delay = self.backoff_s * (2**attempt)
        if retry_after:
            try:
                delay = max(delay, min(float(retry_after), 60.0))
            except ValueError:
                pass
        time.sleep(delay)

    @staticmethod
    def _parse(payload: dict, url: str) -> tuple[str, str]:
        try:
            choice = payload["choices"][0]
            text = choice.get("message", {}).get("content") or ""
            reason = choice.get("finish_reason") or "stop"
            # OpenAI's "stop" covers a matched stop string and a natural end alike; vLLM (stop_reason) and SGLang
            # (matched_stop) say which: a token id or None is the model's own end, not the stop string
            for key in ("stop_reason", "matched_stop"):
                if reason == "stop" and key in choice and not isinstance(choice[key], str):
                    reason = "end"
        except (KeyError, IndexError, TypeError, AttributeError):
            raise OpenAIError(f"openai: unexpected reply from {url}: {json.dumps(payload)[:200]}") from None
        if isinstance(text, list):  # content parts
            text = "".join(part.get("text", "") for part in text if isinstance(part, dict))
        return str(text), str(reason)

    # -- text -> Generation ----------------------------------------------------------------

    def _to_generation(self, text: str, api_reason: str, params: SamplingParams) -> Generation:
        finish = "length" if api_reason == "length" else "stop"
        cut = _cut_at_stop(text, params.stop)
        if cut is not None:
            text, finish = cut, "stop"
        elif api_reason == "stop" and len(params.stop) == 1:
            # taken as the stop string matched and dropped by the API; a server that tells a natural end apart
            # (reason "end" from _parse) gets nothing added. Plain OpenAI does not tell: a reply that ended on its
            # own before ``</answer>`` is then credited with the tag (docs/eval.md)
            text += params.stop[0]
        ids = self.encode(text)
        return Generation(token_ids=ids, finish_reason=finish)

    def encode(self, text: str) -> list[int]:
        """Local token ids of ``text`` that decode back to exactly ``text``."""
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []
        if not self._warned_roundtrip and self.tokenizer.decode(ids, skip_special_tokens=True) != text:
            self._warned_roundtrip = True
            warnings.warn(f"openai backend: the local tokenizer does not round-trip the reply {text[:60]!r}", stacklevel=2)
        return ids


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """``text`` up to and including the earliest stop string, or None if none occurs."""
    ends = [text.index(s) + len(s) for s in stops if s and s in text]
    return text[: min(ends)] if ends else None


def _error_detail(exc: urllib.error.HTTPError) -> str:
    try:
        raw = exc.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - best effort only
        return exc.reason or ""
    try:
        error = json.loads(raw).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return raw.strip()[:200] or str(exc.reason or "")


__all__ = ["OpenAIChatBackend", "OpenAIError", "OpenAIConfigError", "DEFAULT_BASE_URL"]
