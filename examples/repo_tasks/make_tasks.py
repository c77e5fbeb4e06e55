"""Generate the repository task suite for coding agents as JSONL (standard library only, deterministic by seed).

Each task is a tiny git repository (`files`), what the agent is told (`prompt`) and hidden checks (`tests`, Python
that raises on failure, run by reward.py on the agent's final repository). A template is one prompt wording, one
bug kind and one code scenario; the split is by template, so a val gain means the policy learnt to fix code under
wordings and scenarios it never trained on (README.md: the table and the rules). `solve(task)` gives the fixed
files of a task this module generated: for the tests, never written to the JSONL.

    python examples/repo_tasks/make_tasks.py > examples/repo_tasks/tasks.jsonl
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from dataclasses import dataclass
from typing import Callable

DEFAULT_SEED = 0
KINDS = ("operator", "off_by_one", "failing_test", "missing_return", "file_value", "rename")


@dataclass(frozen=True)
class Built:
    """One task before numbering: the wording's values, the repository, the fixed files and the hidden checks."""
    values: dict
    files: dict
    fixed: dict  # {path: text} of the files a correct fix changes or adds
    tests: list


@dataclass(frozen=True)
class Template:
    id: str
    kind: str
    split: str
    wording: str  # the prompt, with {placeholders} filled from Built.values
    count: int
    build: Callable[[random.Random], Built]


# ---- checks (hidden; each runs with the repository as working directory and on sys.path)

def imports(*modules: str) -> dict:
    return {"name": f"{' and '.join(modules)} import{'s' if len(modules) == 1 else ''}",
            "code": f"import {', '.join(modules)}\n"}


def equals(module: str, func: str, call: str, expected) -> dict:
    """`call` (an expression using `func`) must equal `expected`; the assertion says what came back."""
    return {"name": f"{call} == {expected!r}",
            "code": f"from {module} import {func}\ngot = {call}\n"
                    f"assert got == {expected!r}, {call + ' returned '!r} + repr(got) + "
                    f"{f', expected {expected!r}'!r}\n"}


def file_checks(path: str, value) -> list[dict]:
    return [{"name": f"{path} exists", "code": f"import os\nassert os.path.isfile({path!r}), '{path} is missing'\n"},
            {"name": f"{path} holds {value}",
             "code": f"text = open({path!r}).read().strip()\n"
                     f"assert text == {str(value)!r}, f'{path} holds {{text[:40]!r}}, expected {value}'\n"}]


def shown(value) -> str:
    """A number as a person writes it (6.0 -> 6)."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def test_file(module: str, func: str, asserts: list[str]) -> str:
    """A visible test file that runs with `python test_x.py` as well as with pytest."""
    body = "".join(f"    assert {line}\n" for line in asserts)
    return (f"from {module} import {func}\n\n\ndef test_{func}():\n{body}\n\n"
            f'if __name__ == "__main__":\n    test_{func}()\n    print("ok")\n')


def pick(rng: random.Random, *pools):
    return [rng.choice(pool) for pool in pools]


def distinct(draw: Callable[[], object], count: int) -> list:
    """`count` different values of draw() (each check tests a different case)."""
    values = []
    while len(values) < count:
        value = draw()
        if value not in values:
            values.append(value)
    return values


# ---- train templates

def fee_operator(rng):
    module, func = pick(rng, ("cart", "checkout", "billing"), ("with_fee", "add_fee", "plus_fee"))
    fee, price = rng.randint(2, 49), rng.randint(50, 500)
    code = f'def {func}(price):\n    """Return the price plus a fixed fee of {fee}."""\n    return price {{}} {fee}\n'
    return Built({"file": f"{module}.py", "func": func, "fee": fee}, {f"{module}.py": code.format("-")},
                 {f"{module}.py": code.format("+")},
                 [imports(module), equals(module, func, f"{func}(10)", 10 + fee),
                  equals(module, func, f"{func}(0)", fee), equals(module, func, f"{func}({price})", price + fee)])


AREAS = (  # name, args, right expression, wrong expression
    ("rect_area", ("w", "h"), "w * h", "w + h"),
    ("triangle_area", ("base", "height"), "base * height / 2", "base * height * 2"),
    ("square_perimeter", ("side",), "4 * side", "4 + side"),
    ("box_volume", ("w", "h", "d"), "w * h * d", "w * h + d"))


def area_operator(rng):
    module = rng.choice(("shapes", "geometry", "figures"))
    func, params, right, wrong = rng.choice(AREAS)
    cases = distinct(lambda: tuple(rng.randint(2, 12) * (2 if i == 0 else 1) for i in range(len(params))), 3)
    evaluate = lambda expr, args: eval(expr, dict(zip(params, args)))  # noqa: E731 (our own expressions)
    call = lambda args: f"{func}({', '.join(map(str, args))})"  # noqa: E731
    code = f"def {func}({', '.join(params)}):\n    return {{}}\n"
    return Built({"file": f"{module}.py", "call": call(cases[0]), "got": shown(evaluate(wrong, cases[0])),
                  "want": shown(evaluate(right, cases[0]))},
                 {f"{module}.py": code.format(wrong)}, {f"{module}.py": code.format(right)},
                 [imports(module)] + [equals(module, func, call(args), evaluate(right, args)) for args in cases])


CALC_FUNCS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def calc_operator(rng):
    module, buggy = rng.choice(("calc", "arith", "mathops")), rng.choice(tuple(CALC_FUNCS))
    wrong = rng.choice([op for op in "+-*" if op != CALC_FUNCS[buggy]])
    source = lambda bad: "\n\n".join(  # noqa: E731
        f"def {name}(a, b):\n    return a {wrong if bad and name == buggy else op} b\n"
        for name, op in CALC_FUNCS.items())
    b = rng.randint(2, 9)
    pairs = distinct(lambda: (rng.randint(3, 13) * b, b), 2)
    checks = [equals(module, buggy, f"{buggy}({x}, {y})", eval(f"{x} {CALC_FUNCS[buggy]} {y}")) for x, y in pairs]
    others = [name for name in CALC_FUNCS if name != buggy]
    checks.append({"name": f"{', '.join(others)} still work",
                   "code": f"import {module}\n" + "".join(
                       f"assert {module}.{name}(12, 4) == {eval(f'12 {CALC_FUNCS[name]} 4')!r}, "
                       f"'{name}(12, 4) is wrong'\n" for name in others)})
    return Built({"file": f"{module}.py", "func": buggy}, {f"{module}.py": source(True)},
                 {f"{module}.py": source(False)}, [imports(module)] + checks)


def range_off_by_one(rng):
    module, func = pick(rng, ("numbers", "seq", "counting"), ("count_up", "one_to", "upto"))
    n, m = rng.randint(4, 12), rng.randint(13, 30)
    code = f"def {func}(n):\n    return list(range(1, {{}}))\n"
    return Built({"file": f"{module}.py", "func": func, "n": n, "nm1": n - 1},
                 {f"{module}.py": code.format("n")}, {f"{module}.py": code.format("n + 1")},
                 [imports(module), equals(module, func, f"{func}({n})", list(range(1, n + 1))),
                  equals(module, func, f"{func}(1)", [1]), equals(module, func, f"len({func}({m}))", m)])


def slice_off_by_one(rng):
    module, func = pick(rng, ("lists", "listutil", "seqtools"), ("first_n", "take", "head"))
    items = rng.sample(range(1, 60), rng.randint(5, 7))
    n = rng.randint(2, len(items) - 1)
    code = f"def {func}(items, n):\n    return items[:{{}}]\n"
    return Built({"file": f"{module}.py", "func": func, "example": items, "n": n, "got": items[:n - 1]},
                 {f"{module}.py": code.format("n - 1")}, {f"{module}.py": code.format("n")},
                 [imports(module), equals(module, func, f"{func}({items}, {n})", items[:n]),
                  equals(module, func, f"{func}([7, 8, 9], 1)", [7]),
                  equals(module, func, f"{func}({items}, {len(items)})", items)])


def loop_off_by_one(rng):
    module, func = pick(rng, ("series", "sums", "totals"), ("sum_to", "total_upto", "triangle"))
    n, m = rng.randint(4, 15), rng.randint(16, 40)
    code = f"def {func}(n):\n    total = 0\n    for i in range({{}}):\n        total += i\n    return total\n"
    return Built({"file": f"{module}.py", "func": func, "n": n, "want": n * (n + 1) // 2},
                 {f"{module}.py": code.format("n")}, {f"{module}.py": code.format("n + 1")},
                 [imports(module), equals(module, func, f"{func}({n})", n * (n + 1) // 2),
                  equals(module, func, f"{func}(1)", 1), equals(module, func, f"{func}({m})", m * (m + 1) // 2)])


FORMULAS = (  # module, function, parameters, right expression, wrong expression
    ("pricing", "discount", ("price", "off"), "price - off", "price + off"),
    ("wages", "weekly_pay", ("hours", "rate"), "hours * rate", "hours + rate"),
    ("distance", "travelled", ("speed", "time"), "speed * time", "speed - time"))


def test_operator(rng):
    module, func, params, right, wrong = rng.choice(FORMULAS)
    cases = distinct(lambda: (rng.randint(20, 120), rng.randint(2, 19)), 3)
    evaluate = lambda expr, args: eval(expr, dict(zip(params, args)))  # noqa: E731
    code = f"def {func}({', '.join(params)}):\n    return {{}}\n"
    test = test_file(module, func, [f"{func}({a}, {b}) == {evaluate(right, (a, b))}" for a, b in cases[:1]])
    return Built({"file": f"{module}.py", "test_file": f"test_{module}.py"},
                 {f"{module}.py": code.format(wrong), f"test_{module}.py": test}, {f"{module}.py": code.format(right)},
                 [imports(module)] + [equals(module, func, f"{func}({a}, {b})", evaluate(right, (a, b)))
                                      for a, b in cases])


UNITS = (("timeunits", "to_minutes", "hours", 60), ("lengths", "to_cm", "metres", 100),
         ("weights", "to_grams", "kg", 1000))


def test_constant(rng):
    module, func, param, factor = rng.choice(UNITS)
    wrong = rng.choice([f for f in (10, 50, 600, 6, 1024, 12, 24, 36) if f != factor])
    cases = rng.sample(range(2, 40), 3)
    code = f"def {func}({param}):\n    return {param} * {{}}\n"
    test = test_file(module, func, [f"{func}({cases[0]}) == {cases[0] * factor}"])
    return Built({"file": f"{module}.py", "test_file": f"test_{module}.py"},
                 {f"{module}.py": code.format(wrong), f"test_{module}.py": test}, {f"{module}.py": code.format(factor)},
                 [imports(module)] + [equals(module, func, f"{func}({x})", x * factor) for x in cases])


def scale_missing_return(rng):
    module, func = pick(rng, ("helpers", "mathutil", "numtools"), ("scale", "multiply_by", "times"))
    k, x = rng.randint(2, 12), rng.randint(3, 30)
    code = f'def {func}(x):\n    """Return x times {k}."""\n    result = x * {k}\n'
    return Built({"file": f"{module}.py", "func": func}, {f"{module}.py": code},
                 {f"{module}.py": code + "    return result\n"},
                 [imports(module), equals(module, func, f"{func}({x})", x * k),
                  equals(module, func, f"{func}(0)", 0), equals(module, func, f"{func}(-1)", -k)])


NAMES = ("Ana", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia")


def greet_missing_return(rng):
    module, func, word = pick(rng, ("greetings", "messages", "text"), ("greet", "welcome", "salute"),
                              ("Hello", "Hi", "Welcome", "Good day"))
    name, other = rng.sample(NAMES, 2)
    code = f'def {func}(name):\n    message = "{word}, " + name + "!"\n'
    return Built({"file": f"{module}.py", "func": func, "name": name, "greeting": word},
                 {f"{module}.py": code}, {f"{module}.py": code + "    return message\n"},
                 [imports(module), equals(module, func, f"{func}({name!r})", f"{word}, {name}!"),
                  equals(module, func, f"{func}({other!r})", f"{word}, {other}!")])


def predicate_missing_return(rng):
    module = rng.choice(("checks", "predicates", "validators"))
    k = rng.randint(10, 200)
    func, expr, desc, samples = rng.choice((
        ("is_even", "n % 2 == 0", "n is even", (4, 7, 0)),
        ("is_positive", "n > 0", "n is greater than zero", (5, -3, 0)),
        ("is_big", f"n > {k}", f"n is greater than {k}", (k + 1, k, k - 5)),
        ("is_small", f"n < {k}", f"n is less than {k}", (k - 1, k, k + 5))))
    code = f"def {func}(n):\n    {{}}{expr}\n"
    return Built({"file": f"{module}.py", "func": func, "desc": desc}, {f"{module}.py": code.format("")},
                 {f"{module}.py": code.format("return ")},
                 [imports(module)] + [equals(module, func, f"{func}({n})", eval(expr, {"n": n})) for n in samples])


README = "# Scratch repository\n\nWork files for small calculations.\n"


def file_sum(rng):
    target, a, b = rng.choice(("total.txt", "sum.txt", "answer.txt")), rng.randint(10, 99), rng.randint(10, 99)
    return Built({"target": target, "a": a, "b": b}, {"README.md": README}, {target: f"{a + b}\n"},
                 file_checks(target, a + b))


def file_product(rng):
    target, a, b = rng.choice(("product.txt", "result.txt", "out.txt")), rng.randint(3, 25), rng.randint(3, 25)
    return Built({"target": target, "a": a, "b": b}, {"README.md": README}, {target: f"{a * b}\n"},
                 file_checks(target, a * b))


def file_difference(rng):
    target, a = rng.choice(("diff.txt", "difference.txt", "value.txt")), rng.randint(60, 300)
    b = rng.randint(5, a - 10)
    return Built({"target": target, "a": a, "b": b}, {"README.md": README}, {target: f"{a - b}\n"},
                 file_checks(target, a - b))


def rename_pair(rng, pairs, renames, entry):
    """A function defined in one file and called in another; the fix renames it in both."""
    lib, main = rng.choice(pairs)
    old, new, body, arg, value = renames(rng)
    lib_code = f"def {{}}({arg[0]}):\n    return {body}\n"
    main_code = f"from {lib} import {{0}}\n\n\ndef {entry}():\n    return {{0}}({arg[1]})\n"
    files = {f"{lib}.py": lib_code.format(old), f"{main}.py": main_code.format(old)}
    fixed = {f"{lib}.py": lib_code.format(new), f"{main}.py": main_code.format(new)}
    checks = [imports(lib, main),
              {"name": f"{lib}.py defines {new} and no longer {old}",
               "code": f"import {lib}\nassert hasattr({lib}, {new!r}), '{lib}.py has no {new}'\n"
                       f"assert not hasattr({lib}, {old!r}), '{lib}.py still defines {old}'\n"},
              {"name": f"{main}.{entry}() == {value!r}",
               "code": f"import {main}\ngot = {main}.{entry}()\n"
                       f"assert got == {value!r}, {f'{main}.{entry}() returned '!r} + repr(got) + "
                       f"{f', expected {value!r}'!r}\n"},
              {"name": f"{main}.py no longer mentions {old}",
               "code": f"import {main}\n"
                       f"assert {old!r} not in open('{main}.py').read(), '{main}.py still mentions {old}'\n"}]
    return Built({"old": old, "new": new, "lib_file": f"{lib}.py", "main_file": f"{main}.py"}, files, fixed, checks)


def _totals(rng):
    items = [rng.randint(1, 30) for _ in range(rng.randint(3, 5))]
    old, new, body, value = rng.choice((("calc_total", "compute_total", "sum(items)", sum(items)),
                                        ("get_count", "count_items", "len(items)", len(items)),
                                        ("biggest", "largest_item", "max(items)", max(items))))
    return old, new, body, ("items", items), value


def rename_function(rng):
    return rename_pair(rng, (("util", "main"), ("tools", "app"), ("common", "cli")), _totals, "run")


def _text_helpers(rng):
    word = rng.choice(("  hello  ", "  ready ", " done   ", "  go  ", " stop ", "  wait "))
    old, new, body, value = rng.choice((("shout", "make_loud", "text.upper()", word.upper()),
                                        ("clean", "strip_spaces", "text.strip()", word.strip()),
                                        ("yell", "uppercase_text", "text.strip().upper()", word.strip().upper())))
    return old, new, body, ("text", repr(word)), value


def rename_helper(rng):
    return rename_pair(rng, (("textfmt", "app"), ("strtools", "script"), ("fmt", "program")), _text_helpers, "main")


# ---- val templates (new wordings and scenarios; see README.md)

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


TEMPLATES = (
    Template("fee-operator", "operator", "train",
             "In {file}, {func}(price) should add a fee of {fee} to the price, but it subtracts it. "
             "Fix the operator.", 15, fee_operator),
    Template("area-operator", "operator", "train",
             "{call} in {file} gives {got}, but it should give {want}. One operator is wrong; please fix it.",
             15, area_operator),
    Template("calc-operator", "operator", "train", "Fix the bug in {file}: {func} uses the wrong operator.",
             15, calc_operator),
    Template("range-off-by-one", "off_by_one", "train",
             "{func}(n) in {file} should return the numbers from 1 to n inclusive, but {func}({n}) stops at {nm1}. "
             "Fix the off-by-one error.", 15, range_off_by_one),
    Template("slice-off-by-one", "off_by_one", "train",
             "{file}: {func}(items, n) is supposed to return the first n items, but {func}({example}, {n}) gives "
             "{got}. Please fix it.", 15, slice_off_by_one),
    Template("loop-off-by-one", "off_by_one", "train",
             "{func}(n) in {file} must add up 1 + 2 + ... + n (so {func}({n}) is {want}), but the loop misses the "
             "last number. Fix it.", 15, loop_off_by_one),
    Template("test-operator", "failing_test", "train",
             "The test in {test_file} fails. Fix {file} so that it passes, without changing the test.",
             15, test_operator),
    Template("test-constant", "failing_test", "train",
             "Running `python {test_file}` raises an AssertionError. Make the test pass by correcting {file}.",
             15, test_constant),
    Template("scale-missing-return", "missing_return", "train",
             "{file}: {func}() computes its result but never returns it, so callers get None. "
             "Add the missing return.", 15, scale_missing_return),
    Template("greet-missing-return", "missing_return", "train",
             "{func}('{name}') in {file} returns None instead of '{greeting}, {name}!'. Make it return the message.",
             15, greet_missing_return),
    Template("predicate-missing-return", "missing_return", "train",
             "{file}: {func}(n) always gives None. It should return True when {desc} and False otherwise.",
             15, predicate_missing_return),
    Template("file-sum", "file_value", "train",
             "Create a file {target} that holds the sum of {a} and {b} (just the number).", 15, file_sum),
    Template("file-product", "file_value", "train", "Write the product of {a} and {b} into {target}.",
             15, file_product),
    Template("file-difference", "file_value", "train",
             "Put the result of {a} minus {b} in {target}; the file should contain only that number.",
             15, file_difference),
    Template("rename-function", "rename", "train",
             "Rename the function {old} to {new} in {lib_file} and update the call in {main_file}.",
             15, rename_function),
    Template("rename-helper", "rename", "train",
             "The helper {old} in {lib_file} should be called {new}. Rename it everywhere it appears "
             "({lib_file} and {main_file}).", 15, rename_helper),
    Template("val-bank-operator", "operator", "val",
             "Bug report: after {func}({b}, {a}) the balance went up to {wrong} instead of down to {right}. "
             "The code lives in {file}.", 13, bank_operator),
    Template("val-pages-off-by-one", "off_by_one", "val",
             "{func}({first}, {last}) says {wrong}, yet pages {first} through {last} are {right} pages when you "
             "count both ends. Correct the function in {file}.", 13, pages_off_by_one),
    Template("val-test-missing-return", "failing_test", "val",
             "{test_file} is red. Find out why and repair {file}; the test itself is correct.",
             13, test_missing_return),
    Template("val-fahrenheit-missing-return", "missing_return", "val",
             "Nothing comes back from {func}() in {file}: {func}({c}) is None, not {f}. It has to hand back the "
             "converted value.", 13, fahrenheit_missing_return),
    Template("val-file-minutes", "file_value", "val",
             "How many minutes are in {hours} hours? Save only the number in {target}.", 13, file_minutes),
    Template("val-file-from-data", "file_value", "val",
             "{data_file} lists some numbers, one per line. Store their total in {target}.", 13, file_from_data),
    Template("val-rename-style", "rename", "val",
             "Our style guide wants the name {new} instead of {old}. Update {lib_file}, where it is defined, and "
             "{main_file}, where it is called.", 13, rename_style),
)
TEMPLATES_BY_ID = {template.id: template for template in TEMPLATES}


def generate(seed: int = DEFAULT_SEED) -> list[tuple[dict, dict]]:
    """(task, fixed files) for every task: each template's tasks distinct, then shuffled and numbered by seed."""
    pairs = []
    for template in TEMPLATES:
        rng, seen = random.Random(f"{seed}:{template.id}"), set()
        while len(seen) < template.count:
            built = template.build(rng)
            prompt = template.wording.format(**built.values)
            key = json.dumps([prompt, built.files], sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            task = {"template": template.id, "kind": template.kind, "split": template.split, "prompt": prompt,
                    "files": built.files, "tests": built.tests}
            pairs.append((task, built.fixed))
    random.Random(seed).shuffle(pairs)
    return [({"id": f"repo-{index:04d}", **task}, fixed) for index, (task, fixed) in enumerate(pairs, start=1)]


def make(seed: int = DEFAULT_SEED) -> list[dict]:
    return [task for task, _ in generate(seed)]


@functools.lru_cache(maxsize=4)
def _solutions(seed: int) -> dict[str, dict]:
    return {_key(task): fixed for task, fixed in generate(seed)}


def _key(task: dict) -> str:
    return json.dumps([task["template"], task["prompt"], task["files"]], sort_keys=True)


def solve(task: dict, seed: int = DEFAULT_SEED) -> dict[str, str]:
    """The repository after a correct fix ({path: text}, every file) of a task `make(seed)` generated."""
    fixed = _solutions(seed).get(_key(task))
    if fixed is None:
        raise KeyError(f"task {task.get('id')} is not one make(seed={seed}) generates")
    return {**task["files"], **fixed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    for task in make(args.seed):
        sys.stdout.write(json.dumps(task) + "\n")


if __name__ == "__main__":
    main()
