"""The OpenHands agent itself, run by the openhands venv's Python (openhands-sdk + openhands-tools, Python 3.12+).

It builds the SDK's LLM on the rollout's proxy (OpenAI Chat Completions through litellm), an Agent with the
terminal and file-editor tools, and a local Conversation whose workspace is the task repository; it runs the
conversation to the end (bounded by --max-iterations) with no confirmations, and writes {final_message,
execution_status} to --result. run.py starts it with the environment that turns off everything that calls out.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from openhands.sdk import LLM, Agent, Conversation, Tool
from openhands.sdk.conversation.response_utils import get_agent_final_response
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.terminal import TerminalTool


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, type=Path)
    parser.add_argument("--prompt-file", required=True, type=Path)
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-iterations", type=int, default=30)
    return parser.parse_args()


def build_agent(base_url: str, model: str) -> Agent:
    """The agent on the proxy: Chat Completions pinned (no API guess from the model name), the SDK's own retries
    (they ride out a proxy paused for a weight update). The key leaves the environment here, so the commands the
    agent runs do not inherit it."""
    llm = LLM(model=f"openai/{model}", base_url=base_url, api_key=os.environ.pop("LIGHTNING_API_KEY"),
              usage_id="agent", api_mode="chat", caching_prompt=False)
    tools = [Tool(name=TerminalTool.name, params={"terminal_type": "subprocess"}), Tool(name=FileEditorTool.name)]
    return Agent(llm=llm, tools=tools)


def main() -> None:
    args = parse_args()
    conversation = Conversation(agent=build_agent(args.base_url, args.model), workspace=str(args.repo),
                                max_iteration_per_run=args.max_iterations, visualizer=None)
    conversation.send_message(args.prompt_file.read_text())
    conversation.run()
    state = conversation.state
    args.result.write_text(json.dumps({"final_message": get_agent_final_response(state.events),
                                       "execution_status": str(state.execution_status.value)}))
    conversation.close()


if __name__ == "__main__":
    main()
