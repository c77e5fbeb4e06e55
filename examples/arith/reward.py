def reward(task, outcome):
    """1.0 when the agent's final number equals the task's answer."""
    answer = (outcome or {}).get("answer")
    try:
        correct = answer is not None and float(answer) == float(task["answer"])
    except (TypeError, ValueError):
        correct = False
    return {"reward": 1.0 if correct else 0.0, "answer": answer, "expected": task["answer"]}
