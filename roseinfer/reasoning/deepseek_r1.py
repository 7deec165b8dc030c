"""DeepSeek-R1's thinking: its template ends the prompt with `<think>\\n`, so the output starts
inside the thinking and only `</think>` appears in it (older templates let the model write the
opening tag; a leading one is dropped). Whatever precedes `</think>` is thinking, even when the
prompt shows no opening tag; an output cut off before `</think>` is all thinking.
"""

from __future__ import annotations

from roseinfer.reasoning.base import Phase, ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    unopened_phase = Phase.THINKING
