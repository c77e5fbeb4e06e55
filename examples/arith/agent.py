"""Demo harness: a tiny tool-using agent for arithmetic word problems, talking to any OpenAI-compatible endpoint.

Protocol (FIELD-NOTES "a demo task that learns"): the model writes `CALC: <expr>`, the harness answers as the
user with `RESULT: <value>`, the model ends with `ANSWER: <n>`; at most 3 calls of 64 tokens each.
Reads OPENAI_BASE_URL and OPENAI_API_KEY; writes {"answer": ..., "turns": ...} to the output file.
Standard library only, so it runs under any Python 3.
"""
import argparse
import json
import os
import re
import urllib.request
import warnings

SYSTEM = "You solve word problems. Use a calculator by writing CALC: <expression>. Finish with ANSWER: <number>."
DEMOS = [
    ("Tom has 23 boxes with 14 apples each. How many apples does he have?", "23*14", "322"),
    ("A shop sold 512 cups on Monday and 379 on Tuesday. How many cups did it sell?", "512+379", "891"),
]
CALC = re.compile(r"CALC:\s*([-+*/() 0-9.]+)")
ANSWER = re.compile(r"ANSWER:\s*(-?[0-9]+(?:\.[0-9]+)?)")


def chat(messages, temperature):
    body = {"model": "policy", "messages": messages, "max_tokens": 64, "temperature": temperature}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"] or ""


def demo_turns():
    turns = []
    for question, expr, value in DEMOS:
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": f"CALC: {expr}"},
                  {"role": "user", "content": f"RESULT: {value}"}, {"role": "assistant", "content": f"ANSWER: {value}"}]
    return turns


def safe_eval(expr):
    if not re.fullmatch(r"[-+*/() 0-9.]+", expr) or "**" in expr:
        return "error"
    try:
        with warnings.catch_warnings():  # "23 (14)" warns that an int is not callable, then fails: an error
            warnings.simplefilter("ignore")
            value = eval(expr, {"__builtins__": {}}, {})  # digits and operators only, checked above
    except Exception:
        return "error"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    task = json.load(open(args.task))
    messages = [{"role": "system", "content": SYSTEM}, *demo_turns(), {"role": "user", "content": task["question"]}]
    answer = None
    for _ in range(3):
        reply = chat(messages, args.temperature)
        messages.append({"role": "assistant", "content": reply})
        found = ANSWER.search(reply)
        if found:
            answer = found.group(1)
            break
        calc = CALC.search(reply)
        messages.append({"role": "user", "content": f"RESULT: {safe_eval(calc.group(1))}" if calc
                         else "Write CALC: <expression> or ANSWER: <number>."})
    json.dump({"answer": answer, "turns": len(messages)}, open(args.out, "w"))
    print(f"answer={answer}")


if __name__ == "__main__":
    main()
