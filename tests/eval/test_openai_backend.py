"""The OpenAI-compatible chat backend against a scripted local server (no network beyond 127.0.0.1)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ragen.cli import main
from ragen.config import load_config
from ragen.models import SamplingParams
from ragen.models.openai_backend import OpenAIChatBackend, OpenAIConfigError, OpenAIError

HIGH = {"Gambler", "Explorer", "Stuntman", "Pirate", "Daredevil", "Smuggler", "Adventurer", "Speculator",
        "Skydiver", "Treasure Hunter", "Bounty Hunter", "Mercenary", "Racer", "Volcanologist"}


def bandit_reply(user_text: str, drop_stop: bool) -> str:
    """Name the high-risk arm found in the prompt (like an API, leave out the stop string if asked)."""
    arm = next(name for name in sorted(HIGH, key=len, reverse=True) if re.search(rf"\b{name}\b", user_text))
    return f"<answer>{arm}" + ("" if drop_stop else "</answer>")


class FakeAPI:
    """``/v1/chat/completions`` with scripted replies; ``fail_first`` requests answer HTTP 500 first."""

    def __init__(self, fail_first: int = 0, drop_stop: bool = True):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.fail_first = fail_first
        self.drop_stop = drop_stop
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with api.lock:
                    api.bodies.append(body)
                    api.headers.append(dict(self.headers))
                    fail = api.fail_first > 0
                    api.fail_first -= int(fail)
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                if fail:
                    return self._send(500, {"error": {"message": "scripted failure"}})
                user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
                text = bandit_reply(user, api.drop_stop)
                reason = "stop"
                self._send(200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": reason}]})

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def api():
    with FakeAPI() as server:
        yield server


def test_ragen_eval_openai_model_solves_bandit(api, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OPENAI_BASE_URL", api.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    out = tmp_path / "report.json"
    # The bandit preset prefills "<answer>"; a chat API cannot, so eval drops it (and says so).
    assert main(["eval", "openai:fake-model", "bandit", "es.val=[]", "trainer.val_episodes=6", "--k", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["success"] == 1.0 and report["pass_at_k"] == 1.0 and report["pass@2"] == 1.0
    assert report["valid_action_rate"] == 1.0
    assert report["baselines"]["expert"]["success"] == 1.0
    assert any("response_prefix" in note for note in report["notes"])
    assert len(api.bodies) == 6 + 6 * 2  # greedy + 2 samples per seed
    table = capsys.readouterr().out
    assert "model, greedy" in table and "expert agent" in table

    greedy, sampled = api.bodies[0], api.bodies[-1]
    assert greedy["model"] == "fake-model" and greedy["temperature"] == 0.0
    assert sampled["temperature"] == pytest.approx(load_config("bandit").rollout.temperature)  # the preset's
    assert greedy["stop"] == ["</answer>"] and greedy["max_tokens"] == 16 and greedy["top_p"] == 1.0
    assert [m["role"] for m in greedy["messages"]] == ["system", "user"]
    assert "Answer format: <answer>...</answer>" in greedy["messages"][1]["content"]
    assert all(h.get("Authorization") == "Bearer sk-test" for h in api.headers)


def test_multi_turn_messages_and_no_key_needed_for_a_local_server(api, monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", api.base_url)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    # max_turn=2: the bandit ends after one pull, so an invalid first answer is needed for a 2nd turn;
    # enable_think=true (and no "<answer>" prefix) makes the scripted reply (no <think>) invalid, hence two user turns.
    assert main(["eval", "openai:m", "bandit", "es.val=[]", "trainer.val_episodes=2", "agent.max_turn=2", "agent.enable_think=true",
                 "agent.response_prefix=''",
                 "--k", "0", "--no-baselines"]) == 0
    second = api.bodies[-1]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][2]["content"].startswith("<answer>") and second["messages"][2]["content"].endswith("</answer>")
    assert "invalid" in second["messages"][3]["content"]
    assert all("Authorization" not in h for h in api.headers)


def test_retry_after_500_then_success(tokenizer):
    with FakeAPI(fail_first=2, drop_stop=False) as server:
        backend = OpenAIChatBackend("m", tokenizer, base_url=server.base_url, api_key="k", max_workers=1, backoff_s=0.01)
        messages = [[{"role": "user", "content": "arms: Teacher, Pirate"}]]
        gens = backend.generate([[1, 2]], SamplingParams(max_new_tokens=8, stop=("</answer>",)), messages=messages)
        assert len(server.bodies) == 3  # two 500s, then the answer
    assert tokenizer.decode(gens[0].token_ids, skip_special_tokens=True) == "<answer>Pirate</answer>"
    assert gens[0].finish_reason == "stop"


def test_retries_are_bounded_and_errors_are_one_line(tokenizer):
    with FakeAPI(fail_first=100) as server:
        backend = OpenAIChatBackend("m", tokenizer, base_url=server.base_url, api_key="k", max_retries=2, backoff_s=0.0)
        with pytest.raises(OpenAIError, match="HTTP 500.*scripted failure"):
            backend.generate([[1]], SamplingParams(), messages=[[{"role": "user", "content": "Pirate"}]])
        assert len(server.bodies) == 3
        bad = OpenAIChatBackend("m", tokenizer, base_url=server.base_url.replace("/v1", "/nope"), api_key="k")
        with pytest.raises(OpenAIError, match="HTTP 404"):  # not retried
            bad.generate([[1]], SamplingParams(), messages=[[{"role": "user", "content": "Pirate"}]])
        assert len(server.bodies) == 4


def test_missing_key_for_the_default_endpoint_is_a_clear_exit_2(monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(OpenAIConfigError):
        OpenAIChatBackend("gpt-x", tokenizer=object())
    assert main(["eval", "openai:gpt-x", "bandit", "--no-baselines"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ragen: error:") and "OPENAI_API_KEY" in err[0]


def test_reply_text_round_trips_through_local_token_ids(tokenizer):
    backend = OpenAIChatBackend("m", tokenizer, base_url="http://127.0.0.1:9/v1", api_key="")
    params = SamplingParams(stop=("</answer>",))
    for text in ["<think>Risky pays more: 0.25 > 0.1.</think><answer>Pirate</answer>",
                 "  spaces\n\nnew\tlines  <answer>Up || Left</answer>",
                 "Unicode café – “quotes” 你好 🚀 <answer>r1c2=3</answer>",
                 "literal <|im_end|> and <|endoftext|> stay text <answer>x</answer>"]:
        gen = backend._to_generation(text, "stop", params)
        assert tokenizer.decode(gen.token_ids, skip_special_tokens=True) == text
    # The API dropped the stop string: it is put back; text after a stop string is cut.
    assert tokenizer.decode(backend._to_generation("<answer>A", "stop", params).token_ids) == "<answer>A</answer>"
    cut = backend._to_generation("<answer>A</answer> and more", "stop", params)
    assert tokenizer.decode(cut.token_ids) == "<answer>A</answer>" and cut.finish_reason == "stop"
    long = backend._to_generation("<answer>A", "length", params)
    assert tokenizer.decode(long.token_ids) == "<answer>A" and long.finish_reason == "length"


@pytest.mark.parametrize("extra,closed", [
    ({}, True),  # plain OpenAI: "stop" is read as the stop string matched (the API cannot tell)
    ({"stop_reason": "</answer>"}, True),  # vLLM: the stop string matched
    ({"stop_reason": None}, False),  # vLLM: the model's own end (EOS)
    ({"matched_stop": 2}, False),  # SGLang: an end token id
    ({"matched_stop": "</answer>"}, True),
])
def test_a_server_that_says_the_model_ended_on_its_own_is_not_credited_with_the_stop_string(tokenizer, extra, closed):
    payload = {"choices": [{"message": {"content": "<answer>A"}, "finish_reason": "stop", **extra}]}
    text, reason = OpenAIChatBackend._parse(payload, "http://x")
    backend = OpenAIChatBackend.__new__(OpenAIChatBackend)
    backend.tokenizer, backend._warned_roundtrip = tokenizer, False
    gen = backend._to_generation(text, reason, SamplingParams(max_new_tokens=8, stop=("</answer>",)))
    assert tokenizer.decode(gen.token_ids) == ("<answer>A</answer>" if closed else "<answer>A")
