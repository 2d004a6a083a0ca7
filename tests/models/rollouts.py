"""A multi-turn Sokoban rollout on the tiny model, shared by the prefix-cache and decode-loop tests (not a test module)."""

import torch

from ragen.agent import AgentConfig, Rollout
from ragen.envs.registry import make
from ragen.models.backend import HFBackend, SamplingParams


def play(tiny, reuse_kv, *, do_sample, settings=None, seeds=(1, 1, 1, 2, 2, 3), max_bytes=None, common_prefix=True,
         batch_size=64):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32", reuse_kv=reuse_kv, reuse_kv_max_bytes=max_bytes,
                        common_prefix=common_prefix, batch_size=batch_size)
    settings = settings or AgentConfig(max_turn=4, max_actions_per_turn=2)
    sampling = SamplingParams(max_new_tokens=20, do_sample=do_sample, temperature=1.0, stop=("</answer>",))
    rollout = Rollout(backend, tokenizer, settings, sampling)
    torch.manual_seed(0)
    trajs = rollout.run([make("sokoban") for _ in seeds], list(seeds), [0, 0, 0, 1, 1, 2][: len(seeds)], "sokoban")
    return trajs, backend
