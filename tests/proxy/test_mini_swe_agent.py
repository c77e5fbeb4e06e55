"""mini-SWE-agent (from PyPI, as a real subprocess) solves a small task through the proxy; every call is recorded."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tests.proxy.fake_upstream import Reply, decode

pytestmark = pytest.mark.e2e


async def test_it_records_every_call_of_a_mini_swe_agent_run(live, fake, recorder, tmp_path):
    _, base = live
    fake.replies.extend([
        Reply(text="I will write the file.", tool_calls=[("bash", json.dumps({"command": "echo 42 > answer.txt"}))]),
        Reply(text="Done, submitting.", tool_calls=[("bash", json.dumps({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}))]),
    ])
    env = {**os.environ, "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "config"),
           "OPENAI_API_KEY": "s1", "OPENAI_BASE_URL": base + "/v1"}
    mini = Path(sys.executable).with_name("mini")
    process = await asyncio.create_subprocess_exec(
        str(mini), "-m", "openai/agent-model", "-t", "Write 42 into answer.txt", "--yolo", "--exit-immediately",
        "-c", "mini.yaml", "-c", f"model.model_kwargs.api_base={base}/v1", "-c", "model.model_kwargs.api_key=s1",
        "-c", "agent.step_limit=5", "-c", "agent.cost_limit=0", "-o", str(tmp_path / "traj.json"),
        cwd=tmp_path, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 240)

    assert process.returncode == 0, output.decode()[-3000:]
    assert (tmp_path / "answer.txt").read_text() == "42\n"
    assert [(c.seq, c.api, c.status_code, c.stream) for c in recorder.calls] == [(0, "chat", 200, False), (1, "chat", 200, False)]
    for call in recorder.calls:
        assert call.prompt_ids and call.completion_ids and len(call.logprobs) == len(call.completion_ids)
        assert decode(call.completion_ids).startswith(call.response["choices"][0]["message"]["content"])
    second = recorder.calls[1].request["messages"]
    assert second[-1]["role"] == "tool" and "returncode" in second[-1]["content"]
    assert recorder.calls[0].request["messages"][0]["role"] == "system"
