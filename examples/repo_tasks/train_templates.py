"""The train templates' scenarios: each builds one task (repository, fixed files, hidden checks) from a seeded rng."""
from __future__ import annotations

from task_builders import Built, distinct, equals, file_checks, imports, pick, rename_pair, shown, test_file


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
