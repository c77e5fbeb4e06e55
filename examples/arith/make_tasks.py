"""Generate the demo's arithmetic word problems as JSONL (deterministic by seed).

Each operator has several train wordings and separate val wordings (other scenarios and phrasings), and the split
goes by wording: every task of a val wording is val, every task of a train wording is train. So val Pass@1 measures
whether the model computes two-number arithmetic from a word problem it has not trained on, not whether it
remembers a sentence. No two tasks share a question, nor an operation on the same two numbers (a*b and b*a, a+b
and b+a count as the same), within a split or across the splits.
"""
import argparse
import json
import random

# op -> split -> template id -> wording; {a} is the larger or first operand, {b} the second.
TEMPLATES = {
    "*": {
        "train": {
            "mul-farmer-rows": "A farmer plants {a} rows of {b} trees. How many trees does he plant?",
            "mul-pen-boxes": "Each box holds {b} pens. How many pens are in {a} boxes?",
            "mul-theater-seats": "A theater has {a} rows with {b} seats in each row. "
                                 "How many seats does the theater have?",
            "mul-baker-trays": "A baker fills {a} trays with {b} cookies on each tray. How many cookies does she bake?",
            "mul-bus-tickets": "A bus ticket costs {b} dollars. How many dollars do {a} tickets cost?",
        },
        "val": {
            "mul-machine-bottles": "A machine makes {b} bottles every minute. "
                                   "How many bottles does it make in {a} minutes?",
            "mul-garden-area": "A garden is {a} metres long and {b} metres wide. What is its area in square metres?",
            "mul-students-marbles": "Each of {a} students brings {b} marbles to class. "
                                    "How many marbles do they bring altogether?",
        },
    },
    "+": {
        "train": {
            "add-library-books": "A library has {a} books and buys {b} more. How many books does it have now?",
            "add-farm-birds": "A farm has {a} chickens and {b} ducks. How many birds does the farm have?",
            "add-savings": "Sam saved {a} dollars in March and {b} dollars in April. "
                           "How many dollars did he save in total?",
            "add-train-passengers": "A train carries {a} passengers, and {b} more get on at the next station. "
                                    "How many passengers are on the train now?",
            "add-school-students": "A school has {a} boys and {b} girls. How many students does the school have?",
        },
        "val": {
            "add-hiker-metres": "A hiker walks {a} metres before lunch and {b} metres after lunch. "
                                "How many metres does she walk in all?",
            "add-stadium-fans": "There are {a} fans in the north stand of a stadium and {b} fans in the south stand. "
                                "How many fans are there altogether?",
            "add-website-visitors": "A website had {a} visitors yesterday and {b} visitors today. "
                                    "How many visitors did it have over the two days?",
        },
    },
    "-": {
        "train": {
            "sub-tank-drained": "A tank holds {a} litres and {b} litres are drained. How many litres are left?",
            "sub-store-shirts": "A store had {a} shirts and sold {b} of them. "
                                "How many shirts does the store have left?",
            "sub-race-metres": "A runner has run {b} metres of a race that is {a} metres long. "
                               "How many metres are left to run?",
            "sub-stickers": "Lena had {a} stickers and gave {b} to her friends. How many stickers does she have now?",
            "sub-truck-boxes": "A truck carries {a} boxes and drops off {b} boxes at a shop. "
                               "How many boxes are still on the truck?",
        },
        "val": {
            "sub-book-pages": "A book has {a} pages and Ben has read {b} of them. "
                              "How many pages does he still have to read?",
            "sub-parking-spaces": "A parking lot has {a} spaces and {b} of them are taken. How many spaces are free?",
            "sub-game-points": "A player needs {a} points to win a game and has scored {b} points. "
                               "How many more points does she need?",
        },
    },
}
OPS = "*+-"


def numbers(op: str, rng: random.Random) -> tuple[int, int]:
    """Two operands: 12..99 for a product, 100..999 for a sum or difference (the larger first for a difference)."""
    a, b = (rng.randint(12, 99), rng.randint(12, 99)) if op == "*" else (rng.randint(100, 999), rng.randint(100, 999))
    if op == "-" and b > a:
        a, b = b, a
    return a, b


def operation_key(op: str, a: int, b: int) -> tuple:
    """The same operation on the same numbers: a*b and b*a (a+b and b+a) are one; a-b is ordered."""
    return (op, a, b) if op == "-" else (op, min(a, b), max(a, b))


def make(count: int = 500, seed: int = 0, val_count: int | None = None):
    """`count` tasks, `val_count` (default a fifth) of them val; the wordings take turns within each split."""
    val_count = count // 5 if val_count is None else val_count
    rng = random.Random(seed)
    wordings = {split: [(op, template) for op in OPS for template in TEMPLATES[op][split]]
                for split in ("train", "val")}
    slots = [("val", wordings["val"][i % len(wordings["val"])]) for i in range(val_count)]
    slots += [("train", wordings["train"][i % len(wordings["train"])]) for i in range(count - val_count)]
    rng.shuffle(slots)
    seen_operations, seen_questions = set(), set()
    for index, (split, (op, template)) in enumerate(slots):
        while True:
            a, b = numbers(op, rng)
            question = TEMPLATES[op][split][template].format(a=a, b=b)
            if operation_key(op, a, b) not in seen_operations and question not in seen_questions:
                break
        seen_operations.add(operation_key(op, a, b))
        seen_questions.add(question)
        answer = {"*": a * b, "+": a + b, "-": a - b}[op]
        yield {"id": f"arith-{index:04d}", "question": question, "answer": answer, "split": split, "template": template}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val", type=int, default=None, help="how many val tasks (default: a fifth of --count)")
    args = parser.parse_args()
    for task in make(args.count, args.seed, args.val):
        print(json.dumps(task))
