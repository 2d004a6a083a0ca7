"""Hand-built one-turn bandit trajectories shared by the training tests (not a test module)."""

from ragen.agent.trajectory import Trajectory, Turn


def _trajectory(tokenizer, group: int, reply: str, reward: float) -> Trajectory:
    prompt = tokenizer("<|im_start|>user\nArms: A, B<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    answer = tokenizer(reply, add_special_tokens=False)["input_ids"]
    traj = Trajectory(env_name="bandit", group_id=group, seed=group)
    traj.input_ids = prompt + answer
    traj.loss_mask = [0] * len(prompt) + [1] * len(answer)
    traj.turn_spans = [(len(prompt), len(traj.input_ids))]
    traj.turns = [Turn(reply, ["A"], True, reward, 0.0)]
    return traj


def _batch_with_shared_prompts(tokenizer):
    from ragen.train.batch import collate

    return collate(shared_prompt_trajectories(tokenizer), tokenizer.pad_token_id)


def shared_prompt_trajectories(tokenizer) -> list[Trajectory]:
    """2 groups x 3 one-turn episodes; each group's rows share a prompt, the groups' prompts differ in length."""
    trajs = []
    for group, arms in enumerate(["Gambler, Clerk", "Pirate, Baker, and a much longer prompt here"]):
        for reply in ["<answer>Gambler</answer>", "<answer>Clerk</answer>", "<answer>no</answer>"]:
            t = _trajectory(tokenizer, group, reply, float(len(reply)))
            prompt = tokenizer(f"<|im_start|>user\nArms: {arms}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
            answer = t.input_ids[t.turn_spans[0][0]:]
            t.input_ids, t.loss_mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
            t.turn_spans = [(len(prompt), len(t.input_ids))]
            trajs.append(t)
    return trajs
