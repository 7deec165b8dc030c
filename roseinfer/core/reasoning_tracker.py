"""A request's place in its thinking, followed token by token in the engine core.

    undecided --<think>--> thinking --</think>--> answering
        \\------- any other token ----------------/

The scheduler feeds it every sampled token (`advance`); the structured-output manager asks it
what the next token may be: a request's grammar holds only while answering (a first token may
also open the thinking), and once the thinking has taken its budget the only token allowed is
the end of thinking (`forced_token`). The text side of the same phases is roseinfer/reasoning.
"""

from __future__ import annotations

from roseinfer.common.messages import ReasoningSpec
from roseinfer.reasoning import Phase


class ReasoningTracker:
    def __init__(self, spec: ReasoningSpec, budget: int | None) -> None:
        self.start_token_id = spec.start_token_id
        self.end_token_id = spec.end_token_id
        self.phase = Phase(spec.phase)
        self.budget = budget
        self.num_thinking_tokens = 0
        # A thinking opened by the prompt may still begin with the start tag (DeepSeek-R1's older
        # templates): that tag is markup, not thinking (the text side drops it too).
        self._may_repeat_start = self.phase == Phase.THINKING

    @property
    def thinking(self) -> bool:
        return self.phase == Phase.THINKING

    @property
    def undecided(self) -> bool:
        return self.phase == Phase.UNDECIDED

    def forced_token(self) -> int | None:
        """The only token the request may sample next, if there is one: the end of thinking
        once the budget is spent."""
        if self.phase == Phase.THINKING and self.budget is not None and self.num_thinking_tokens >= self.budget:
            return self.end_token_id
        return None

    def advance(self, token_id: int) -> bool:
        """Record a sampled token; returns whether it belongs to the answer (the grammar's)."""
        if self.phase == Phase.UNDECIDED:
            self.phase = Phase.THINKING if token_id == self.start_token_id else Phase.ANSWERING
            return self.phase == Phase.ANSWERING
        if self.phase == Phase.THINKING:
            repeated_start = self._may_repeat_start and token_id == self.start_token_id
            self._may_repeat_start = False
            if token_id == self.end_token_id:
                self.phase = Phase.ANSWERING
            elif not repeated_start:
                self.num_thinking_tokens += 1
            return False
        return True
