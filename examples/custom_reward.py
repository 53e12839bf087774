"""A custom reward function, written exactly as for TRL's GRPOTrainer.

Use it from a config with

    [data]
    path = "examples/data/sums.jsonl"       # rows like {"prompt": "12+34=", "answer": 46}

    [rewards]
    functions = ["examples/custom_reward.py:correct_answer"]

grpokit calls the function once per generation batch with keyword arguments:

    prompts         the B*G prompts, each repeated once per completion
    completions     the B*G completion texts (for chat prompts: [{"role": "assistant", "content": ...}])
    completion_ids  the B*G completions' token ids
    answer, ...     every other dataset column, repeated to line up with the completions
    trainer_state, log_extra, log_metric   TRL's extras (ignore them via **kwargs)

It returns one float per completion, or None to leave a sample ungraded by
this function (it is then skipped in the weighted total, not scored 0).
"""

from __future__ import annotations


def correct_answer(completions: list, answer: list, **kwargs) -> list[float | None]:
    """1.0 when the completion is exactly the answer (surrounding spaces ignored), 0.0 otherwise, and
    None for an empty completion (nothing to grade). Works for plain and chat prompts, and for answers
    stored as numbers (JSON) or text (CSV)."""
    rewards: list[float | None] = []
    for completion, expected in zip(completions, answer):
        if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
            completion = completion[-1]["content"]
        text = completion.strip()
        rewards.append(None if not text else float(text == str(expected).strip()))
    return rewards


if __name__ == "__main__":
    # A quick check without a model: grade four made-up completions of "12+34=".
    from grpokit.rewards.core import RewardSpec, compute_rewards

    per_fn, total = compute_rewards(
        [RewardSpec("correct_answer", correct_answer)],
        prompts=["12+34="] * 4,
        completions=["46", "45", "", [{"role": "assistant", "content": " 46"}]],
        completion_ids=[[0, 0], [0, 0], [], [0, 0]],
        columns={"answer": [46] * 4},
    )
    print(per_fn.squeeze(1).tolist(), total.tolist())  # [1.0, 0.0, nan, 1.0] [1.0, 0.0, nan, 1.0]
