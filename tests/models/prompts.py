"""Prompt batches shared by the backend and prefill tests (not a test module)."""


def prompts_with_groups(tokenizer):
    texts = ["The arms are Apple and Stuntman.", "Sokoban: push the box X onto the target O, please now.", "Hi"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    return [ids[0]] * 3 + [ids[1]] * 2 + [ids[2]] + [ids[0]]  # 7 rows, 3 distinct prompts of different lengths


def templated_prompts(tokenizer, grouped: bool = True):
    """Distinct prompts from one template: a long common prefix, then differing states of different lengths."""
    head = ("System: you play a game. Rules: move the box onto the target; answer with one action. "
            "Walls block you; boxes move only when pushed. Every move costs a little; a solved level pays. State:")
    ids = [tokenizer(head + s)["input_ids"] for s in [" box left", " the box is far to the right of you", " wall"]]
    rows = [ids[0]] * 2 + [ids[1]] * 2 + [ids[2]] * 2
    return rows if grouped else rows[::2] + rows[1::2]
