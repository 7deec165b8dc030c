"""A test-only fault in the model step, off unless the environment asks for it.

With ROSEINFER_TEST_FAULT_TOKEN_ID=<id> set when the model runner is built, every step that runs a
request whose prompt holds that token id raises `InjectedFault`, as a failing kernel would. The
reliability tests start a real server with it to check that a failing step ends only the request
that causes it; nothing else reads the variable.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

FAULT_TOKEN_ENV = "ROSEINFER_TEST_FAULT_TOKEN_ID"


class InjectedFault(RuntimeError):
    """The fault a test asked for."""


def fault_token_from_env() -> int | None:
    value = os.environ.get(FAULT_TOKEN_ENV)
    return int(value) if value else None


def raise_if_faulty(fault_token_id: int, prompts: Iterable[Sequence[int]]) -> None:
    if any(fault_token_id in prompt for prompt in prompts):
        raise InjectedFault(f"injected fault: a prompt holds token {fault_token_id} ({FAULT_TOKEN_ENV})")
