"""A task of your own, as a user writes one: prompts in a JSON lines file and a reward with the
signature of TRL's GRPO rewards. Each prompt is a word of 3 to 6 random letters and '='; the answer
is the word's last letter.

    python scripts/last_letter.py runs/last_letter.jsonl    # 5,000 rows: prompt, answer, completion
    python run.py --task runs/last_letter.jsonl --reward scripts/last_letter.py:last_letter ...

The `completion` column (TRL's prompt-completion format) makes the rows worked examples too, which
--objective likelihood reads.
"""

import json
import random
import sys


def last_letter(prompts, completions, answer, **kwargs) -> list[float]:
    """1 where the completion is the prompt's last letter, else 0."""
    return [
        float(completion == letter) for completion, letter in zip(completions, answer, strict=True)
    ]


def write_task(path: str, rows: int = 5000, seed: int = 1) -> None:
    """`rows` distinct words (a fixed seed) as JSON lines: prompt, answer and completion."""
    rng, seen = random.Random(seed), set()
    with open(path, "w") as out:
        while len(seen) < rows:
            word = "".join(
                rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6))
            )
            if word in seen:
                continue
            seen.add(word)
            row = {"prompt": f"{word}=", "answer": word[-1], "completion": word[-1]}
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write_task(sys.argv[1] if len(sys.argv) > 1 else "last_letter.jsonl")
