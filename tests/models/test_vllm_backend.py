"""VLLMBackend without vLLM or a GPU: request/response conversion, weight chunks, and the clear errors.

Nothing here runs vLLM itself; stand-in objects play ``vllm.LLM``'s outputs (``RequestOutput``
with ``outputs[0].token_ids / finish_reason / stop_reason``) and a fake ``vllm`` module plays
the engine for the constructor / generate / sync_weights wiring.
"""

import inspect
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from ragen.cli import main
from ragen.config import ConfigError
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.vllm_backend import (
    WORKER_EXTENSION,
    VLLMBackend,
    VLLMBackendError,
    VLLMUnavailableError,
    VLLMWorkerExtension,
    require_vllm,
    to_generation,
    to_vllm_sampling_kwargs,
    weight_chunks,
)

EOS = 2
#: ``vllm.SamplingParams`` fields (documented for 0.8-0.11); every kwarg we send must be one of them.
VLLM_SAMPLING_FIELDS = {
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "logits_processors",
    "include_stop_str_in_output", "truncate_prompt_tokens", "output_kind",
}


def request_output(token_ids, finish_reason, stop_reason=None):
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, finish_reason=finish_reason, stop_reason=stop_reason)])


# -- request conversion ------------------------------------------------------------------


def test_greedy_request():
    kw = to_vllm_sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5, do_sample=False,
                                                stop=("</answer>",)), eos_ids={EOS, 0})
    assert kw["temperature"] == 0.0 and kw["top_p"] == 1.0 and kw["top_k"] == -1  # greedy ignores the sampling knobs
    assert kw["max_tokens"] == 7 and kw["n"] == 1
    assert kw["stop"] == ["</answer>"] and kw["include_stop_str_in_output"] is True  # ragen keeps </answer>
    assert kw["stop_token_ids"] == [0, EOS] and kw["detokenize"] is True and kw["skip_special_tokens"] is False
    assert "seed" not in kw  # per-request seeds would make a group's identical prompts sample identically
    assert set(kw) <= VLLM_SAMPLING_FIELDS


@pytest.mark.parametrize("top_k, expected", [(0, -1), (5, 5), (1, 1)])
def test_sampling_request_maps_top_k_zero_to_minus_one(top_k, expected):
    kw = to_vllm_sampling_kwargs(SamplingParams(max_new_tokens=128, temperature=0.7, top_p=0.95, top_k=top_k), [EOS])
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.7, 0.95, expected)
    assert kw["max_tokens"] == 128 and kw["stop"] == [] and kw["stop_token_ids"] == [EOS]
    assert set(kw) <= VLLM_SAMPLING_FIELDS


# -- response conversion -----------------------------------------------------------------


def test_length_passes_ids_through():
    gen = to_generation(request_output((5, 6, 7), "length"), {EOS})
    assert gen.token_ids == [5, 6, 7] and gen.finish_reason == "length"
    assert all(type(t) is int for t in gen.token_ids)


def test_eos_is_kept_and_named_eos():
    assert to_generation(request_output([5, 6, EOS], "stop"), {EOS}) == to_generation(request_output([5, 6, EOS], "stop", EOS), {EOS})
    gen = to_generation(request_output([5, 6, EOS], "stop"), {EOS})
    assert gen.token_ids == [5, 6, EOS] and gen.finish_reason == "eos"
    # EOS as the last allowed token: HFBackend says "eos", whatever vLLM reports
    assert to_generation(request_output([5, EOS], "length"), {EOS}).finish_reason == "eos"
    # a stop at an id outside ragen's EOS set (the engine's own EOS) is still an EOS, kept
    assert to_generation(request_output([5, 9], "stop"), {EOS}).token_ids == [5, 9]
    assert to_generation(request_output([5, 9], "stop"), {EOS}).finish_reason == "eos"


def test_stop_string_keeps_the_completing_token():
    gen = to_generation(request_output([44, 11247, 46, 540], "stop", "</answer>"), {EOS})
    assert gen.token_ids == [44, 11247, 46, 540] and gen.finish_reason == "stop"


def test_completion_output_directly_and_abort_is_an_error():
    done = SimpleNamespace(token_ids=[1, 2], finish_reason="length", stop_reason=None)
    assert to_generation(done, {EOS}).token_ids == [1, 2]
    with pytest.raises(VLLMBackendError, match="abort"):
        to_generation(request_output([1], "abort"), {EOS})
    with pytest.raises(VLLMBackendError):
        to_generation(request_output([1], None), {EOS})


def test_vllm_ids_are_where_hfbackend_cuts(tiny):
    """The ids vLLM returns (ending at the EOS / the stop-string token / the length limit) are what HFBackend keeps."""
    model, tokenizer = tiny
    hf = HFBackend(model, tokenizer, precision="fp32")
    params = SamplingParams(max_new_tokens=12, stop=("</answer>",))
    answer = tokenizer("<answer>left</answer>")["input_ids"]
    more = tokenizer(" and more")["input_ids"]
    pad = [hf.pad_id] * 3  # HF pads a row that finished before the batch did
    cases = [  # (what HF generate returns for the row, what vLLM returns, vLLM's finish/stop reasons)
        (answer + pad, answer, ("stop", "</answer>")),
        (more + [EOS] + pad, more + [EOS], ("stop", None)),
        (more + [EOS] + pad, more + [EOS], ("stop", EOS)),  # EOS passed as stop_token_ids
        (more, more, ("length", None)),
        (more + [EOS], more + [EOS], ("length", None)),
    ]
    assert EOS in hf.eos_ids
    for hf_row, vllm_ids, (finish, stop_reason) in cases:
        assert to_generation(request_output(vllm_ids, finish, stop_reason), hf.eos_ids) == hf._cut(hf_row, params)


# -- weight sync -------------------------------------------------------------------------


def test_weight_chunks_split_by_bytes_cast_and_detach():
    w = torch.nn.Parameter(torch.ones(4, 4))  # 64 bytes in fp32, 32 in bf16
    items = [("a", w), ("b", torch.zeros(4)), ("c", torch.zeros(100)), ("d", torch.zeros(2))]
    chunks = list(weight_chunks(items, torch.bfloat16, max_bytes=40))
    assert [[n for n, _ in c] for c in chunks] == [["a", "b"], ["c"], ["d"]]  # 32+8; 200 alone; 4
    assert all(t.dtype == torch.bfloat16 and not t.requires_grad and t.device.type == "cpu" for c in chunks for _, t in c)
    assert [n for c in weight_chunks(items) for n, _ in c] == ["a", "b", "c", "d"]
    assert next(iter(weight_chunks(items)))[0][1].dtype == torch.float32  # dtype None: as is


def test_worker_extension_loads_into_the_model_runner():
    loaded = []
    worker = VLLMWorkerExtension()
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda weights: loaded.extend(weights)))
    assert worker.ragen_load_weights([["x", torch.ones(1)], ("y", torch.zeros(1))]) == 2  # lists survive serialisation
    assert [n for n, _ in loaded] == ["x", "y"]


# -- availability errors -----------------------------------------------------------------


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(VLLMUnavailableError, match=r"pip install 'ragen\[vllm\]'") as info:
        require_vllm()
    assert "rollout.engine=auto" in str(info.value) and isinstance(info.value, ConfigError)
    with pytest.raises(VLLMUnavailableError, match="not installed"):
        VLLMBackend("/nonexistent", SimpleNamespace(pad_token_id=0, eos_token_id=EOS))


def test_no_gpu_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(VLLMUnavailableError) as info:
        require_vllm()
    message = str(info.value)
    assert "CUDA GPU" in message and "rollout.engine=auto" in message and "pip install" not in message


def test_train_with_engine_vllm_exits_2_with_the_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)
    out = tmp_path / "run"
    assert main(["train", "bandit", "model=tiny", "rollout.engine=vllm", f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine=vllm" in err and "pip install 'ragen[vllm]'" in err and "rollout.engine=auto" in err
    assert "Traceback" not in err and not out.exists()  # failed before the run dir or the model
    assert main(["train", "bandit", "model=tiny", "rollout.engine=vllm", "lora.rank=4", f"trainer.output_dir={out}"]) == 2
    assert "LoRA" in capsys.readouterr().err


# -- the backend's wiring, against a fake vllm module ----------------------------------------


class FakeLLM:
    def __init__(self, model, **engine):
        import os

        self.model_files = sorted(os.listdir(model))  # the temp dir exists while the engine starts
        self.engine = engine
        self.rpcs, self.resets, self.requests = [], 0, None

    def generate(self, requests, sampling, use_tqdm=True):
        self.requests, self.sampling = requests, sampling
        replies = {0: ([7, 8, EOS], "stop", None), 1: ([9, 9], "length", None)}
        return [request_output(*replies[i % 2]) for i in range(len(requests))]

    def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        return [None]

    def reset_prefix_cache(self):
        self.resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: dict(kw)
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return vllm


def test_backend_wiring_with_a_fake_engine(fake_vllm, tiny):
    model, tokenizer = tiny
    backend = VLLMBackend(model, tokenizer, precision="bf16", seed=3, max_model_len=512)
    llm = backend.llm
    assert "config.json" in llm.model_files and any(f.endswith(".safetensors") for f in llm.model_files)
    assert llm.engine["dtype"] == "bfloat16" and llm.engine["seed"] == 3 and llm.engine["max_model_len"] == 512
    assert llm.engine["worker_extension_cls"] == WORKER_EXTENSION == "ragen.models.vllm_backend.VLLMWorkerExtension"
    hf = HFBackend(model, tokenizer)
    assert backend.eos_ids == hf.eos_ids and backend.pad_id == hf.pad_id  # same conventions as HFBackend

    gens = backend.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=5, top_k=0, stop=("</answer>",)))
    assert llm.requests == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4]}]
    assert llm.sampling.max_tokens == 5 and llm.sampling.top_k == -1 and llm.sampling.stop == ["</answer>"]
    assert [(g.token_ids, g.finish_reason) for g in gens] == [([7, 8, EOS], "eos"), ([9, 9], "length")]
    assert backend.generate([], SamplingParams()) == []

    named = [(n, p) for n, p in model.named_parameters()]
    assert backend.sync_weights(named, max_bytes=1 << 16) == len(named)
    assert {m for m, _ in llm.rpcs} == {"ragen_load_weights"} and len(llm.rpcs) > 1  # chunked
    sent = [pair for _, (chunk,) in llm.rpcs for pair in chunk]
    assert [n for n, _ in sent] == [n for n, _ in named]
    assert all(t.dtype == torch.bfloat16 for _, t in sent) and llm.resets == 1  # engine dtype; stale KV blocks dropped


def test_backend_signature_matches_hf_generate():
    assert list(inspect.signature(VLLMBackend.generate).parameters) == list(inspect.signature(HFBackend.generate).parameters)
