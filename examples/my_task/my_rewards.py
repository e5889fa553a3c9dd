"""Reward functions for the my_task example, in TRL's signature: each gets the batch's completions and every
column of the dataset as a keyword list (here `solution` and `carry`, plus `prompts` and `problem`), and
returns one float per completion, or None for a completion it cannot score (an invalid reward)."""


def first_line(completion: str) -> str:
    return completion.strip().split("\n", 1)[0].strip()


def digit_credit(completions: list[str], solution: list[str], **kwargs) -> list[float | None]:
    """1 for the exact sum; else half the share of digits in the right place (right-aligned), so a near miss
    beats nonsense and evolution strategies see which members are closer."""
    rewards: list[float | None] = []
    for completion, gold in zip(completions, solution):
        answer = first_line(completion)
        if answer == gold:
            rewards.append(1.0)
            continue
        width = max(len(answer), len(gold))
        rewards.append(0.5 * sum(a == g for a, g in zip(answer.rjust(width), gold.rjust(width))) / width)
    return rewards


def carry_bonus(completions: list[str], solution: list[str], carry: list[bool], **kwargs) -> list[float | None]:
    """An extra point for an exact answer to a problem whose units carry (the harder half)."""
    return [float(has_carry and first_line(completion) == gold)
            for completion, gold, has_carry in zip(completions, solution, carry)]
