"""Generate the demo's arithmetic word problems as JSONL (deterministic by seed)."""
import argparse
import json
import random

TEMPLATES = {
    "*": "A farmer plants {a} rows of {b} trees. How many trees does he plant?",
    "+": "A library has {a} books and buys {b} more. How many books does it have now?",
    "-": "A tank holds {a} litres and {b} litres are drained. How many litres are left?",
}


def make(count: int, seed: int):
    rng = random.Random(seed)
    for index in range(count):
        op = rng.choice("*+-")
        a, b = (rng.randint(12, 99), rng.randint(12, 99)) if op == "*" else (rng.randint(100, 999), rng.randint(100, 999))
        if op == "-" and b > a:
            a, b = b, a
        answer = {"*": a * b, "+": a + b, "-": a - b}[op]
        yield {"id": f"arith-{index:04d}", "question": TEMPLATES[op].format(a=a, b=b), "answer": answer,
               "split": "val" if index % 5 == 0 else "train"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for task in make(args.count, args.seed):
        print(json.dumps(task))
