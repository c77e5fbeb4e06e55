"""The parts every repository task is built from: Built, the hidden checks, the visible test file, value helpers."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Built:
    """One task before numbering: the wording's values, the repository, the fixed files and the hidden checks."""
    values: dict
    files: dict
    fixed: dict  # {path: text} of the files a correct fix changes or adds
    tests: list


# Hidden checks: each runs with the repository as working directory and on sys.path.

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
