"""Collapse ("echo trap") signals, computed from each step's trajectories and update metrics.

RAGEN (Wang et al. 2025, §4) finds that multi-turn RL collapses into repetitive, prompt-agnostic
answers, and that the collapse is announced: the in-group reward std and the policy entropy
fall before success does, and gradient-norm spikes mark the point of no return. RAGEN-2 adds
*template collapse*: the reasoning stops depending on the input. Every signal below is logged
under ``collapse/`` each step; :class:`CollapseMonitor` turns them into console warnings (and an
optional stop). See ``docs/collapse.md`` for the definitions and thresholds.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from ragen.agent.trajectory import Trajectory


def _bigrams(text: str) -> set[tuple[str, str]]:
    words = text.split()
    return set(zip(words, words[1:])) if len(words) > 1 else {(w, "") for w in words}


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def collapse_signals(trajectories: list[Trajectory]) -> dict[str, float]:
    """Diversity and dependence-on-input of one step's responses.

    * ``collapse/in_group_reward_std`` -- mean over groups of the std of episode rewards within the
      group: 0 means every group agrees and GRPO-style updates get no signal. Left out when no group
      has two episodes (``rollout.group_size=1``): there is no in-group spread to measure, and a 0
      would read as "every group agrees".
    * ``collapse/distinct_2`` -- distinct word bigrams / all bigrams over the step's first responses
      (left out when no response has two words: one-word answers have no bigrams to repeat).
    * ``collapse/cross_prompt_similarity`` -- mean bigram-Jaccard similarity of first responses to
      *different* prompts (groups); near 1 means the model answers every input the same way.
    * ``collapse/prompt_response_mi`` -- plug-in mutual information I(prompt; response) in bits over
      exact first-turn responses, divided by H(prompt); 0 means responses carry no information
      about the input (template collapse, RAGEN-2), 1 means they identify it.
    """
    ok = [t for t in trajectories if t.turns and not t.error]
    if not ok:
        return {}
    by_group: dict[int, list[Trajectory]] = defaultdict(list)
    for t in ok:
        by_group[t.group_id].append(t)
    stds = [statistics.pstdev([t.reward for t in g]) for g in by_group.values() if len(g) > 1]
    responses = [t.turns[0].response for t in ok]
    all_bigrams = [bg for r in responses for bg in zip(r.split(), r.split()[1:])]
    out = {"collapse/in_group_reward_std": statistics.fmean(stds)} if stds else {}
    if all_bigrams:
        out["collapse/distinct_2"] = len(set(all_bigrams)) / len(all_bigrams)
    firsts = [(gid, _bigrams(g[0].turns[0].response)) for gid, g in sorted(by_group.items())]
    pairs = [(a, b) for i, (_, a) in enumerate(firsts) for (_, b) in firsts[i + 1 :]]
    if pairs:
        out["collapse/cross_prompt_similarity"] = statistics.fmean(_jaccard(a, b) for a, b in pairs)
    out["collapse/prompt_response_mi"] = normalised_mutual_information([(t.group_id, t.turns[0].response) for t in ok])
    return out


def normalised_mutual_information(pairs: list[tuple[object, object]]) -> float:
    """I(X; Y) / H(X) from samples ``(x, y)`` (plug-in estimate; 0 if H(X) = 0)."""
    n = len(pairs)
    if n == 0:
        return 0.0
    px, py, pxy = Counter(x for x, _ in pairs), Counter(y for _, y in pairs), Counter(pairs)
    h_x = -sum(c / n * math.log2(c / n) for c in px.values())
    if h_x == 0:
        return 0.0
    mi = sum(c / n * math.log2((c / n) / ((px[x] / n) * (py[y] / n))) for (x, y), c in pxy.items())
    return max(0.0, mi / h_x)


@dataclass
class CollapseMonitor:
    """Warns when the signals cross thresholds; ``should_stop`` once a collapse is confirmed.

    Thresholds (documented in ``docs/collapse.md``): in-group reward std below ``std_floor`` for ``patience``
    consecutive steps; a habit metric (``habit_metrics``: an env's ``train/info_<name>`` share that a policy
    ignoring its input pins to 0 or 1) within ``habit_margin`` of 0 or 1 for ``patience`` steps; a gradient norm
    above ``spike_factor`` × the running median of the previous ones (an infinite one too; it is kept out of the
    median); cross-prompt similarity above ``similarity_ceiling``. Entropy below ``entropy_floor`` warns only beside
    one of those: a policy that settles on one answer per prompt is what a one-shot task trains for, not a collapse.
    A collapse is confirmed once low entropy and a flat in-group reward std (or a habit) coincide for ``patience``
    consecutive steps.
    """

    entropy_floor: float = 0.05
    std_floor: float = 1e-3
    spike_factor: float = 5.0
    similarity_ceiling: float = 0.9
    patience: int = 3
    habit_metrics: tuple[str, ...] = ()
    habit_margin: float = 0.02
    _grad_norms: list[float] = field(default_factory=list)
    _habit_steps: dict[str, int] = field(default_factory=dict)
    _flat_steps: int = 0
    #: Consecutive steps whose responses to different prompts were alike (cross-prompt similarity over the ceiling).
    _similar_steps: int = 0
    #: Consecutive steps with both low entropy and a flat in-group reward std.
    _collapse_steps: int = 0
    collapsed: bool = False

    def check(self, metrics: dict[str, float]) -> list[str]:
        warnings: list[str] = []
        entropy = metrics.get("actor/entropy")
        low_entropy = entropy is not None and entropy < self.entropy_floor
        std = metrics.get("collapse/in_group_reward_std")
        if std is not None:
            self._flat_steps = self._flat_steps + 1 if std < self.std_floor else 0
            if self._flat_steps >= self.patience:
                warnings.append(f"in-group reward std ~0 for {self._flat_steps} steps: no learning signal left")
        habit = pinned_now = False
        for name in self.habit_metrics:
            share = metrics.get(f"train/info_{name}")
            if share is None or math.isnan(share):
                continue
            pinned = share <= self.habit_margin or share >= 1 - self.habit_margin
            pinned_now = pinned_now or pinned
            self._habit_steps[name] = self._habit_steps.get(name, 0) + 1 if pinned else 0
            if self._habit_steps[name] >= self.patience:
                habit = True
                warnings.append(f"{name} share {share:.2f} for {self._habit_steps[name]} steps: the answers follow a "
                                "habit, not the input")
        if low_entropy and (warnings or habit):
            warnings.insert(0, f"policy entropy {entropy:.3f} < {self.entropy_floor} beside the signal below: "
                               "the policy is locking in")
        grad = metrics.get("actor/grad_norm")
        if grad is not None and not math.isnan(grad):
            history = [g for g in self._grad_norms[-20:] if g > 0]
            if len(history) >= 5 and grad > self.spike_factor * statistics.median(history):
                warnings.append(f"grad norm spike {grad:.3g} > {self.spike_factor} x running median {statistics.median(history):.3g}")
            if math.isfinite(grad):
                self._grad_norms.append(grad)
        # Alike answers to different prompts for `patience` steps in a row: one step of them is common where answers
        # are short actions (most FrozenLake maps open with the same moves) and says nothing of the reasoning.
        similarity = metrics.get("collapse/cross_prompt_similarity")
        if similarity is not None and not math.isnan(similarity):
            self._similar_steps = self._similar_steps + 1 if similarity > self.similarity_ceiling else 0
            if self._similar_steps >= self.patience:
                warnings.append(f"cross-prompt similarity {similarity:.2f} > {self.similarity_ceiling} for "
                                f"{self._similar_steps} steps: template collapse")
        # Confirmed collapse: low entropy together with no reward variance left, for `patience` steps in a row.
        if entropy is not None or std is not None:
            both = low_entropy and ((std is not None and std < self.std_floor) or pinned_now)
            self._collapse_steps = self._collapse_steps + 1 if both else 0
        if self._collapse_steps >= self.patience:
            self.collapsed = True
        return warnings

    def replay(self, history: Iterable[dict[str, float]]) -> None:
        """Feed the logged metrics of steps already run through :meth:`check` (warnings dropped): a resumed run's
        monitor then counts flat steps and judges spikes as the uninterrupted run's would. ``collapsed`` is left
        False: a run resumed after stopping on a collapse goes on until the next step confirms it again."""
        for metrics in history:  # metrics.jsonl writes NaN as null: a logged NaN is NaN again, not "not logged"
            self.check({k: math.nan if v is None else v for k, v in metrics.items()})
        self.collapsed = False
