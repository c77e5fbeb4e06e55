"""The val templates' scenarios: wordings and code the train templates never show (README.md: the rules)."""
from __future__ import annotations

from task_builders import Built, distinct, equals, file_checks, imports, pick, rename_pair, shown, test_file


def bank_operator(rng):
    module, func = pick(rng, ("account", "wallet", "ledger"), ("withdraw", "take_out", "spend"))
    balance, amount = rng.randint(100, 900), rng.randint(10, 99)
    code = f"def {func}(balance, amount):\n    return balance {{}} amount\n"
    return Built({"file": f"{module}.py", "func": func, "b": balance, "a": amount, "wrong": balance + amount,
                  "right": balance - amount},
                 {f"{module}.py": code.format("+")}, {f"{module}.py": code.format("-")},
                 [imports(module), equals(module, func, f"{func}({balance}, {amount})", balance - amount),
                  equals(module, func, f"{func}(50, 50)", 0), equals(module, func, f"{func}(1000, 1)", 999)])


def pages_off_by_one(rng):
    module, func = pick(rng, ("printer", "booklet", "pages"), ("pages_between", "page_count", "span"))
    first = rng.randint(1, 40)
    last = first + rng.randint(2, 30)
    code = f"def {func}(first, last):\n    return last - first{{}}\n"
    return Built({"file": f"{module}.py", "func": func, "first": first, "last": last, "wrong": last - first,
                  "right": last - first + 1},
                 {f"{module}.py": code.format("")}, {f"{module}.py": code.format(" + 1")},
                 [imports(module), equals(module, func, f"{func}({first}, {last})", last - first + 1),
                  equals(module, func, f"{func}(5, 5)", 1), equals(module, func, f"{func}(1, 100)", 100)])


def test_missing_return(rng):
    module, func = pick(rng, ("stock", "inventory", "warehouse"), ("restock", "add_units", "receive"))
    cases = distinct(lambda: (rng.randint(0, 50), rng.randint(1, 40)), 2)
    code = f"def {func}(count, added):\n    new_count = count + added\n"
    test = test_file(module, func, [f"{func}({a}, {b}) == {a + b}" for a, b in cases[:1]])
    return Built({"file": f"{module}.py", "test_file": f"test_{module}.py"},
                 {f"{module}.py": code, f"test_{module}.py": test}, {f"{module}.py": code + "    return new_count\n"},
                 [imports(module)] + [equals(module, func, f"{func}({a}, {b})", a + b) for a, b in cases]
                 + [equals(module, func, f"{func}(0, 0)", 0)])


def fahrenheit_missing_return(rng):
    module, func = pick(rng, ("temperature", "thermo", "climate"), ("to_fahrenheit", "c_to_f", "fahrenheit"))
    celsius = rng.choice([c for c in range(-20, 105, 5) if c != 100])  # 100 is a check of its own
    code = f"def {func}(celsius):\n    fahrenheit = celsius * 9 / 5 + 32\n"
    to_f = lambda c: c * 9 / 5 + 32  # noqa: E731
    return Built({"file": f"{module}.py", "func": func, "c": celsius, "f": shown(to_f(celsius))},
                 {f"{module}.py": code}, {f"{module}.py": code + "    return fahrenheit\n"},
                 [imports(module), equals(module, func, f"{func}({celsius})", to_f(celsius)),
                  equals(module, func, f"{func}(100)", 212.0), equals(module, func, f"{func}(-40)", -40.0)])


NOTES = "Notes\n=====\n\nAnswers to small questions go in their own files.\n"


def file_minutes(rng):
    target, hours = rng.choice(("minutes.txt", "mins.txt", "duration.txt")), rng.randint(2, 48)
    return Built({"target": target, "hours": hours}, {"NOTES.md": NOTES}, {target: f"{hours * 60}\n"},
                 file_checks(target, hours * 60))


def file_from_data(rng):
    data, target = pick(rng, ("prices.txt", "amounts.txt", "costs.txt"), ("grand_total.txt", "spent.txt",
                                                                          "overall.txt"))
    numbers = [rng.randint(5, 95) for _ in range(rng.randint(3, 4))]
    return Built({"data_file": data, "target": target}, {data: "".join(f"{n}\n" for n in numbers)},
                 {target: f"{sum(numbers)}\n"}, file_checks(target, sum(numbers)))


def _readings(rng):
    readings = [rng.randint(5, 30) for _ in range(3)]
    readings[2] += (3 - sum(readings) % 3) % 3  # a whole mean
    old, new, body, value = rng.choice((("avg_temp", "mean_temperature", "sum(readings) / len(readings)",
                                         sum(readings) / 3),
                                        ("max_temp", "highest_temperature", "max(readings)", max(readings)),
                                        ("min_temp", "lowest_temperature", "min(readings)", min(readings))))
    return old, new, body, ("readings", readings), value


def rename_style(rng):
    return rename_pair(rng, (("weather", "report"), ("sensors", "dashboard"), ("readings", "summary")), _readings,
                       "build")
