"""``agent.context_mode=window``: each turn's prompt holds the instructions and the last W turns."""

import pytest
import torch

from ragen.agent import AgentConfig, Rollout
from ragen.agent.rollout import window_messages
from ragen.models.backend import SamplingParams
from ragen.train.batch import collate, collate_turns
from test_context import ScriptedBackend, WalkEnv

REPLIES = ["<answer>Right</answer>", "garbage", "<answer>Right</answer>", "<answer>Right</answer>"]


def play(tokenizer, window: int, replies=REPLIES, mode: str = "window"):
    backend = ScriptedBackend(tokenizer, replies, eos=True)
    settings = AgentConfig(max_turn=len(replies), enable_think=False, context_mode=mode, max_context_window=window)
    [traj] = Rollout(backend, tokenizer, settings, SamplingParams()).run([WalkEnv()], [0], [0], "walk")
    return traj, backend


def test_window_messages_keep_system_last_turns_and_the_task():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]
    assert window_messages(msgs, 5, "H") == msgs  # everything fits: the full conversation
    assert window_messages(msgs, 2, "H") == msgs
    assert window_messages(msgs, 1, "H") == [msgs[0], {"role": "user", "content": "H\n\nu2"}, msgs[4], msgs[5]]
    assert window_messages(msgs, 0, "H") == [msgs[0], {"role": "user", "content": "H\n\nu3"}]
    assert window_messages(msgs[1:], 0, "H") == [{"role": "user", "content": "H\n\nu3"}]  # no system message


@pytest.mark.parametrize("window", [0, 1, 2])
def test_each_turn_is_generated_from_its_window(tokenizer, window):
    traj, backend = play(tokenizer, window)
    assert traj.success and len(traj.turns) == 4  # Right, (invalid), Right, Right: pos 0 → 3
    # the backend saw exactly the recorded window prompts, and the model wrote exactly the sampled ids
    assert backend.prompts == traj.window_prompts
    assert [traj.input_ids[s:e] for s, e in traj.turn_spans] == backend.sampled
    texts = [tokenizer.decode(p) for p in traj.window_prompts]
    for k, text in enumerate(texts):
        assert WalkEnv.instructions in text  # the task is stated in every prompt
        assert f"Turn {k + 1}:" in text  # the current observation
        shown = {j for j in range(1, 5) if f"Turn {j}:" in text}
        assert shown == set(range(max(1, k + 1 - window), k + 2)), (k, shown)  # only the last `window` turns
    # turn 1's window is the first prompt itself; the episode record still holds the whole history
    assert traj.window_prompts[0] == traj.input_ids[: traj.turn_spans[0][0]]
    assert len(traj.input_ids) > max(len(p) for p in traj.window_prompts)


def test_full_mode_records_no_windows(tokenizer):
    traj, backend = play(tokenizer, 1, mode="full")
    assert traj.window_prompts == []
    for prompt in backend.prompts:  # full mode: every prompt is a prefix of the episode
        assert traj.input_ids[: len(prompt)] == prompt


def test_turn_rows_train_only_the_sampled_ids_and_map_back_to_the_episode(tokenizer):
    episodes = [play(tokenizer, 1)[0], play(tokenizer, 0, replies=REPLIES[:2])[0]]
    pad = tokenizer.pad_token_id
    full = collate(episodes, pad)
    rows, index = collate_turns(episodes, pad)
    assert len(rows) == 4 + 2
    assert rows.group_ids.tolist() == [0] * 6
    for r, (e, k) in enumerate([(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]):
        traj = episodes[e]
        s, t = traj.turn_spans[k]
        n = len(traj.window_prompts[k]) + (t - s)
        assert rows.input_ids[r, :n].tolist() == traj.window_prompts[k] + traj.input_ids[s:t]
        masked = rows.input_ids[r, 1:][rows.response_mask[r].bool()].tolist()  # the targets trained on
        assert masked == traj.input_ids[s:t]
    # every masked target of either layout is mapped once, onto the same token
    assert len(index.turn_row) == int(rows.response_mask.sum()) == int(full.response_mask.sum())
    assert torch.equal(rows.input_ids[index.turn_row, index.turn_pos + 1], full.input_ids[index.episode_row, index.episode_pos + 1])
    # the maps are inverse on the response targets, and put nothing elsewhere
    x = torch.randn(full.response_mask.shape) * full.response_mask
    there = index.to_turns(x, rows.response_mask.shape)
    assert torch.equal(there * rows.response_mask, there)
    assert torch.equal(index.to_episodes(there, full.response_mask.shape), x)


def test_turn_rows_need_window_prompts(tokenizer):
    traj, _ = play(tokenizer, 1, mode="full")
    with pytest.raises(ValueError, match="context_mode=window"):
        collate_turns([traj], tokenizer.pad_token_id)
