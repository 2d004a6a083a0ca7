"""The KV cache travels under the installed transformers' own name, so no call leans on a deprecated alias."""

import warnings

import torch

from ragen.agent import AgentConfig, Rollout
from ragen.envs.registry import make
from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.cache_names import CACHE_KWARG, output_cache, with_cache
from ragen.train.logprobs import policy_forward


def test_the_name_is_the_one_model_outputs_carry():
    model, _ = load_model("tiny")
    out = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
    assert CACHE_KWARG in out.keys()
    assert output_cache(out) is out[CACHE_KWARG]
    assert with_cache(None, use_cache=True) == {"use_cache": True, CACHE_KWARG: None}


def test_kept_cache_rollout_and_shared_prompt_update_raise_no_deprecation_warning():
    model, tokenizer = load_model("tiny")
    backend = HFBackend(model, tokenizer, precision="fp32", reuse_kv=True)
    sampling = SamplingParams(max_new_tokens=8, do_sample=False, stop=("</answer>",))
    rollout = Rollout(backend, tokenizer, AgentConfig(max_turn=2), sampling)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trajs = rollout.run([make("sokoban") for _ in range(2)], [1, 1], [0, 0], "sokoban")
        assert backend.stats.reused_tokens > 0  # turn 2 resumed turn 1's cache (a cache was passed in)
        ids = torch.tensor([trajs[0].input_ids, trajs[1].input_ids])  # (2, L): same seed, same greedy tokens
        mask = torch.tensor([trajs[0].loss_mask[1:], trajs[1].loss_mask[1:]])  # (2, L-1)
        prompt_lengths = mask.argmax(dim=1) + 1
        policy_forward(model, ids, torch.ones_like(ids), mask, prompt_lengths=prompt_lengths)
    deprecated = [str(w.message) for w in caught if "deprecated" in str(w.message) and "cache" in str(w.message)]
    assert deprecated == []
