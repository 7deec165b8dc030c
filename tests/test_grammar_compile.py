"""Grammar compiles that are slow or no longer wanted (structured_output/compile_pool.py): a
compile past `--grammar-compile-timeout` fails its requests with an error naming the field, and a
compile whose requests were all aborted stops holding its seat, so the next grammar compiles while
the first one's thread still runs. Outcomes and order only: no durations are asserted.

The slow grammar is a JSON Schema `anyOf` of thousands of objects, each with its own pattern: near
llguidance's size limits, it takes it about 1.5 s to compile here (a trivial schema: milliseconds).
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError

import openai
import pytest
from engine_core_support import make_core, request
from live_server import ServerProcess

from roseinfer.errors import InvalidRequestError
from roseinfer.structured_output import GrammarCompiler, StructuredOutputsParams
from roseinfer.structured_output.compile_pool import CompileAbandoned

MODEL = "SmolLM2-135M-Instruct"


def slow_schema(variant: int = 0) -> dict:
    return {"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^p{variant}x{i}[a-z]{{3,9}}$"}},
         "required": [f"k{i}"]}
        for i in range(6000)
    ]}


def ref_chain(length: int) -> dict:
    """Objects whose one property is the next definition, `length` deep through `$ref`s."""
    return {"$defs": {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
                      for i in range(length)} | {f"d{length}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def slow_params(variant: int = 0) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=slow_schema(variant))


def fast_params(word: str = "yes") -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=[word, "no"])


def wait_for(condition, what: str, limit: float = 120.0) -> None:
    """Poll until `condition()`; the limit only keeps a broken build from hanging the suite."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def one_seat(smollm_tokenizer):
    """A compiler with one seat, so a compile that held on to it would block the next."""
    compiler = GrammarCompiler(smollm_tokenizer, max_workers=1)
    yield compiler
    wait_for(lambda: compiler.pool.num_orphans == 0, "the orphaned compile to end")
    compiler.shutdown()


def test_a_compile_past_its_time_limit_fails_naming_the_field(smollm_tokenizer):
    compiler = GrammarCompiler(smollm_tokenizer, max_workers=1, compile_timeout=0.05)
    try:
        with pytest.raises(InvalidRequestError) as caught:
            compiler.compile(slow_params())
        assert caught.value.param == "structured_outputs.json"
        assert "--grammar-compile-timeout" in str(caught.value)
        # The timed-out compile gave its seat back while its thread runs on: a grammar compiles now
        # (with no limit: on a busy machine even a trivial grammar may take longer than 0.05 s).
        compiler.pool.timeout = None
        assert compiler.compile(fast_params()).new_grammar() is not None
        assert compiler.pool.num_orphans == 1
        # A failed compile is not cached: the same grammar is compiled anew next time.
        assert len(compiler.cached_keys()) == 1
    finally:
        wait_for(lambda: compiler.pool.num_orphans == 0, "the orphaned compile to end")
        compiler.shutdown()


def test_an_abandoned_compile_gives_its_seat_to_the_next(one_seat):
    slow = one_seat.compile_async(slow_params())
    wait_for(lambda: one_seat.pool.num_running == 1, "the slow compile to start")
    one_seat.release(slow)  # its only request was aborted
    with pytest.raises(CompileAbandoned):
        slow.result()
    fast = one_seat.compile_async(fast_params())
    assert fast.result().new_grammar() is not None
    # The fast grammar compiled on the only seat while the slow compile's thread still ran.
    assert one_seat.pool.num_orphans == 1
    assert one_seat.cached_keys() == [one_seat_key(fast_params())]


def test_a_shared_compile_goes_on_while_one_waiter_is_left(one_seat):
    first = one_seat.compile_async(slow_params())
    second = one_seat.compile_async(slow_params())  # a second request, the same grammar
    assert second is first
    one_seat.release(first)
    queued = one_seat.compile_async(fast_params())
    assert not queued.done() and one_seat.pool.num_orphans == 0  # the slow one still holds the seat
    assert first.result().new_grammar() is not None  # the second request still gets its grammar
    assert queued.result().new_grammar() is not None


def test_a_queued_compile_nobody_waits_for_is_cancelled(one_seat):
    slow = one_seat.compile_async(slow_params())
    queued = one_seat.compile_async(fast_params("maybe"))
    one_seat.release(queued)
    assert queued.cancelled()
    with pytest.raises(CancelledError):
        queued.result()
    assert one_seat_key(fast_params("maybe")) not in one_seat.cached_keys()
    # Asked for again, it is compiled anew rather than handed the cancelled future.
    again = one_seat.compile_async(fast_params("maybe"))
    assert again is not queued
    one_seat.release(slow)
    assert again.result().new_grammar() is not None


def one_seat_key(params: StructuredOutputsParams) -> str:
    import hashlib

    return hashlib.sha256(params.cache_key.encode()).hexdigest()


def test_aborted_requests_stop_holding_the_engines_compile_seats(smollm_gguf_path):
    """Both seats taken by slow grammars whose requests are then aborted (their clients left): a
    constrained request that comes next compiles and finishes while those compiles still run.

    The slow compiles take ~1.5 s, which a loaded machine can stretch the fast request past (it
    happened once in a full suite), so the race gets three tries with fresh grammars; were the
    seats still held, the fast request could only compile after a slow one ended, in every try."""
    core = make_core(smollm_gguf_path, num_kv_blocks=32, block_size=16)
    try:
        pool = core.structured_output_manager.compiler.pool
        orphans_at_finish = []
        for attempt in range(3):
            slow = [request(f"slow-{attempt}-{i}", [1, 2, 3, 4],
                            structured_outputs=slow_params(attempt * pool.max_workers + i))
                    for i in range(pool.max_workers)]
            for each in slow:
                core.add_request(each)
            wait_for(lambda: pool.num_running == pool.max_workers, "both slow compiles to start")
            core.abort_requests([each.request_id for each in slow])
            core.add_request(request(f"fast-{attempt}", [1, 2, 3, 4], max_tokens=4, ignore_eos=False,
                                     structured_outputs=fast_params()))
            finished = None
            while finished is None:
                finished = next((o for o in core.step().outputs if o.request_id == f"fast-{attempt}" and o.finished),
                                None)
            assert finished.finish_reason == "stop" and finished.error is None
            orphans_at_finish.append(pool.num_orphans)
            wait_for(lambda: pool.num_orphans == 0, "the orphaned compiles to end")
            if orphans_at_finish[-1] == pool.max_workers:  # the aborted requests' compiles were still running
                break
        assert orphans_at_finish[-1] == pool.max_workers, orphans_at_finish
    finally:
        core.shutdown()


def test_slow_and_too_deep_grammars_are_400s_naming_the_field():
    """The live server, through the official client: a schema deep enough to overflow llguidance's
    stack (it killed the server with SIGSEGV: test_grammar_limits.py) is a 400 naming the field; so
    is a compile's time-out (not a 500). The server then stops cleanly while the timed-out compile
    still runs (the interpreter waits for it rather than finalizing under it)."""
    server = ServerProcess("--kv-cache-memory", "0.25", "--grammar-compile-timeout", "0.05")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": ref_chain(1000)}})
        assert caught.value.body["param"] == "response_format.json_schema.schema", caught.value.body
        # Still serving (unconstrained: with a 0.05 s limit even a trivial grammar could time out
        # on a busy machine).
        answer = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=4)
        assert answer.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                      extra_body={"structured_outputs": {"json": slow_schema()}})
        error = caught.value.body
        assert error["param"] == "structured_outputs.json", error
        assert "--grammar-compile-timeout" in error["message"], error
    finally:
        assert server.stop() == 0, server.output()
    assert "Traceback" not in server.output()


def test_shutdown_tells_whoever_still_waits(one_seat):
    running = one_seat.compile_async(slow_params())
    queued = one_seat.compile_async(fast_params())
    one_seat.shutdown()
    with pytest.raises(CompileAbandoned):
        running.result()
    assert queued.cancelled()


def test_compile_threads_are_not_daemons_even_when_started_from_one(one_seat):
    """The interpreter must wait for a running compile at exit: llguidance's native code running on
    while Python finalizes crashed the server (SIGSEGV) when it stopped right after a time-out."""
    import threading

    futures = []
    starter = threading.Thread(target=lambda: futures.append(one_seat.compile_async(slow_params())), daemon=True)
    starter.start()
    starter.join()
    compiling = [t for t in threading.enumerate() if t.name == "grammar-compile"]
    assert compiling and not any(t.daemon for t in compiling)
    assert futures[0].result().new_grammar() is not None
