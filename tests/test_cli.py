"""The command line as a user runs it: `roseinfer generate` and the seed's offline example, in a
subprocess on the default model, against `LLM.generate` in this process; and clear errors."""

import re
import subprocess
import sys

import pytest
from support import EXACT_FLAGS

from roseinfer import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 12


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False
    )


def expected_output(llm, prompts: list[str], chat: bool) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return "".join(f"### request {i}\n{o.outputs[0].text}\n\n" for i, o in enumerate(outputs))


@pytest.mark.parametrize("chat", [False, True])
def test_generate_prints_each_request_like_the_seed(default_llm, chat):
    flags = ["--chat"] if chat else []
    result = run_cli("-m", "roseinfer.cli", "generate", *flags, *EXACT_FLAGS, "--max-new-tokens", str(NEW_TOKENS),
                     *PROMPTS)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_output(default_llm, PROMPTS, chat)


def test_seed_offline_example_flags(default_llm):
    result = run_cli(
        "-m", "roseinfer.offline_example", "--prompts", *PROMPTS, "--max-new-tokens", str(NEW_TOKENS),
        "--no-amp", *EXACT_FLAGS,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_output(default_llm, PROMPTS, chat=False)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
        (["--temperature", "-1", "--do-sample"], "temperature must be >= 0"),
        (["--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
        (["--top-k", "-3"], "top_k must be"),
        (["--model", "/no/such/model.gguf"], "model '/no/such/model.gguf' not found"),
    ],
)
def test_bad_arguments_exit_with_a_message_naming_them(flags, message):
    result = run_cli("-m", "roseinfer.cli", "generate", *flags, "Hello")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert re.search(message, result.stderr), result.stderr
