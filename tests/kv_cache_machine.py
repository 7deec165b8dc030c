"""The request lifecycle the block managers' and the KV coordinator's property tests drive
(tests/test_kv_cache_manager*.py): fork (where the manager shares prompts), free, the scheduler's
end-of-step caching, and the manager's own invariants. A machine subclassing this holds `manager`, `ids`, and per request its
`tokens` and `salts`."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule


class RequestLifecycleMachine(RuleBasedStateMachine):
    @precondition(lambda self: self.tokens and getattr(self.manager, "shares_prompts", True))
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = next(self.ids)
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(request_id)
        del self.tokens[request_id], self.salts[request_id]

    @rule()
    def end_step(self) -> None:
        """What the scheduler does after a step: cache every block that is full and computed."""
        for request_id, tokens in self.tokens.items():
            self.manager.cache_computed_blocks(request_id, tokens, len(tokens), self.salts[request_id])

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.manager.check_invariants()
