"""EngineLoop and ReplicaCore over a fake engine: one thread, fan-out, abort, failure."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cluster.serving.engine_loop import IDLE_POLL_S, EngineLoop, EngineLoopError
from cluster.serving.messages import Accepted, GenerateError, GenerateRequest
from cluster.serving.replica_core import ReplicaCore, StreamPacing, build_engine, check_supported
from configs.schema import load_config
from workers.outputs import EngineOutput
from workers.sampling.params import SamplingParams
from workers.step_failure import StepFailed


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class FakeEngine:
    """One token per step per request; records the threads that touched it."""

    tokenizer = FakeTokenizer()

    def __init__(self, fail_at_step: int | None = None, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.live: dict[str, list[int]] = {}
        self.budget: dict[str, int] = {}
        self.aborted: list[str] = []
        self.stopped: list[str] = []
        self.threads: set[str] = set()
        self.steps = 0
        self.fail_at_step = fail_at_step

    def _touch(self) -> None:
        self.threads.add(threading.current_thread().name)

    def add_request(self, rid: str, ids: list[int], params: SamplingParams, output_prefix=()) -> None:
        self._touch()
        assert not output_prefix
        if any(t < 0 for t in ids):
            raise ValueError(f"token ids {[t for t in ids if t < 0]} are outside the vocabulary")
        self.live[rid], self.budget[rid] = [], params.max_tokens

    def has_unfinished(self) -> bool:
        self._touch()
        return bool(self.live)

    def step(self) -> list[EngineOutput]:
        self._touch()
        self.steps += 1
        time.sleep(self.step_s)
        if self.fail_at_step == self.steps:
            raise RuntimeError("kernel exploded")
        outs = []
        for rid in list(self.live):
            self.live[rid].append(len(self.live[rid]))
            done = len(self.live[rid]) >= self.budget[rid]
            outs.append(self._out(rid, done, "length" if done else None))
            if done:
                del self.live[rid]
        return outs

    def abort(self, rid: str) -> EngineOutput | None:
        self._touch()
        if rid not in self.live:
            return None
        self.aborted.append(rid)
        del self.live[rid]
        return EngineOutput(rid, [], None, True, "abort", None, 0)

    def stop(self, rid: str) -> EngineOutput | None:
        self.stopped.append(rid)
        return self.abort(rid)

    def check_workers(self) -> None:
        self._touch()

    def record_cache_events(self) -> None:
        pass

    def drain_cache_events(self) -> list:
        return []

    def _out(self, rid: str, finished: bool, reason: str | None) -> EngineOutput:
        return EngineOutput(rid, self.live[rid][-1:], None, finished, reason, None, 0)


def run(coro):
    return asyncio.run(coro)


async def collect(core: ReplicaCore, req: GenerateRequest) -> list:
    return [item async for item in core.generate(req)]


def test_concurrent_requests_stream_to_completion_on_one_thread():
    async def go():
        engine = FakeEngine()
        loop = await EngineLoop.create(lambda: engine)
        core = ReplicaCore(loop, load_config())
        reqs = [GenerateRequest(f"r{i}", [1, 2], [SamplingParams(max_tokens=3 + i)] * 2) for i in range(3)]
        results = await asyncio.gather(*(collect(core, r) for r in reqs))
        await loop.shutdown()
        return engine, results

    engine, results = run(go())
    assert len(engine.threads) == 1 and next(iter(engine.threads)).startswith("engine")
    for i, items in enumerate(results):
        assert items[0] == Accepted(2)
        chunks = [c for batch in items[1:] for c in batch]
        for choice in (0, 1):
            mine = [c for c in chunks if c.index == choice]
            assert len(mine) == 3 + i and mine[-1].finished and mine[-1].finish_reason == "length"
            assert [t for c in mine for t in c.new_token_ids] == list(range(3 + i))


def paced_stream(pacing: StreamPacing | float, max_tokens: int) -> tuple[list[float], list]:
    """One request's stream items, each with the event loop's time it arrived (5 ms steps)."""

    async def go():
        loop = await EngineLoop.create(lambda: FakeEngine(step_s=0.005))
        core = ReplicaCore(loop, load_config(), pacing)
        clock, stamps, items = asyncio.get_running_loop(), [], []
        async for item in core.generate(GenerateRequest("r", [1], [SamplingParams(max_tokens=max_tokens)])):
            stamps.append(clock.time())
            items.append(item)
        await loop.shutdown()
        return stamps, items

    return run(go())


@pytest.mark.parametrize("interval_s", [0.0, 0.05])
def test_stream_interval_coalesces_steps_but_never_delays_the_first_or_last(interval_s):
    stamps, items = paced_stream(interval_s, 40)
    chunks = [c for batch in items[1:] for c in batch]
    assert [t for c in chunks for t in c.new_token_ids] == list(range(40)) and chunks[-1].finished
    sizes = [len(batch) for batch in items[1:]]
    if interval_s == 0:
        assert max(sizes) <= 2  # about one step per item
    else:
        assert sizes[0] == 1  # the first token is not held back
        # at most one item per interval (however slow a loaded machine makes the steps)
        assert len(sizes) <= (stamps[-1] - stamps[1]) / interval_s + 2 and max(sizes) >= 2
        gaps = [b - a for a, b in zip(stamps[2:], stamps[3:-1])]
        assert all(g >= interval_s * 0.9 for g in gaps), gaps


def test_a_request_that_ends_while_its_stream_is_held_back_is_sent_at_once():
    """The final tokens come out while the stream waits out its interval: they go at once,
    not at the interval's end (that would add up to the interval to E2E and to TPOT)."""
    stamps, items = paced_stream(StreamPacing(interval_s=2.0), 12)
    chunks = [c for batch in items[1:] for c in batch]
    assert [t for c in chunks for t in c.new_token_ids] == list(range(12)) and chunks[-1].finished
    assert len(items) == 3  # Accepted, the first token, the other eleven together
    assert stamps[-1] - stamps[1] < 1.0, stamps  # ~55 ms of steps; held back: 2 s


def test_refused_input_is_an_error_item_and_queues_nothing():
    async def go():
        engine = FakeEngine()
        core = ReplicaCore(await EngineLoop.create(lambda: engine), load_config())
        items = await collect(core, GenerateRequest("bad", [1, -3], [SamplingParams()] * 2))
        await core.shutdown()
        return engine, items

    engine, items = run(go())
    assert len(items) == 1 and isinstance(items[0], GenerateError) and "-3" in items[0].message
    assert engine.live == {}


def test_closing_a_stream_early_aborts_its_unfinished_choices():
    async def go():
        engine = FakeEngine()
        loop = await EngineLoop.create(lambda: engine)
        core = ReplicaCore(loop, load_config())
        gen = core.generate(GenerateRequest("long", [1], [SamplingParams(max_tokens=10_000)] * 2))
        assert isinstance(await gen.__anext__(), Accepted)
        await gen.__anext__()
        await gen.aclose()  # the client went away
        for _ in range(100):
            if not engine.live:
                break
            await asyncio.sleep(0.01)
        streams = loop.num_streams
        await loop.shutdown()
        return engine, streams

    engine, streams = run(go())
    assert sorted(engine.aborted) == ["long-0", "long-1"] and engine.live == {} and streams == 0


def test_a_failing_step_fails_open_streams_and_the_health_check():
    async def go():
        core = ReplicaCore(await EngineLoop.create(lambda: FakeEngine(fail_at_step=2)), load_config())
        with pytest.raises(EngineLoopError, match="kernel exploded"):
            await collect(core, GenerateRequest("r", [1], [SamplingParams(max_tokens=5)]))
        with pytest.raises(RuntimeError, match="kernel exploded"):
            core.check_health()
        with pytest.raises(EngineLoopError):
            await collect(core, GenerateRequest("r2", [1], [SamplingParams(max_tokens=5)]))
        await core.shutdown()

    run(go())


def test_indivisible_tensor_parallel_is_refused_with_a_clear_error():
    check_supported(load_config(overrides={"parallel.tensor_parallel_size": 2}))
    config = load_config(overrides={"parallel.tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide .*num_key_value_heads=2"):
        check_supported(config)
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        build_engine(config)


def test_the_engine_steps_while_the_event_loop_is_busy():
    """The engine thread never waits for the event loop between steps: a busy replica loop
    must not leave the engine idle."""

    async def go():
        engine = FakeEngine(step_s=0.005)
        loop = await EngineLoop.create(lambda: engine)
        gen = ReplicaCore(loop, load_config()).generate(GenerateRequest("r", [1], [SamplingParams(max_tokens=10_000)]))
        assert isinstance(await gen.__anext__(), Accepted)
        await gen.__anext__()
        before = engine.steps
        time.sleep(0.3)  # the event loop is blocked (a busy replica)
        during = engine.steps - before
        await gen.aclose()
        await loop.shutdown()
        return during, loop.times

    during, times = run(go())
    assert during >= 10, during  # ~60 at 5 ms a step; at most 1 if it waited
    assert times.num_steps >= during and times.step_wall_s >= 0.005 * during


def test_stream_pacing_spreads_a_replica_budget_over_its_streams():
    pacing = StreamPacing(interval_s=0.05, items_per_s=100, max_interval_s=0.25)
    assert [pacing.gap(n) for n in (1, 5, 8, 20, 1000)] == [0.05, 0.05, 0.08, 0.2, 0.25]
    assert StreamPacing(0.05).gap(1000) == 0.05  # no budget: the interval alone
    assert StreamPacing(0.3, 100, 0.25).gap(1000) == 0.3  # the interval is a floor
    with pytest.raises(ValueError, match="items_per_s must be >= 0, got -1"):
        StreamPacing(0.05, -1)


def test_a_stream_budget_spaces_each_streams_items_by_the_open_streams():
    """4 streams at 20 items/s together: each stream's items 0.2 s apart (the first and the
    last never held back), where the interval alone would send every 10 ms."""

    async def go():
        loop = await EngineLoop.create(lambda: FakeEngine(step_s=0.005))
        core = ReplicaCore(loop, load_config(), StreamPacing(0.01, 20.0, 1.0))
        clock = asyncio.get_running_loop()

        async def one(i):
            stamps, items = [], []
            async for item in core.generate(GenerateRequest(f"r{i}", [1], [SamplingParams(max_tokens=200)])):
                stamps.append(clock.time())
                items.append(item)
            return stamps, items

        results = await asyncio.gather(*(one(i) for i in range(4)))
        await loop.shutdown()
        return results

    for stamps, items in run(go()):
        chunks = [c for batch in items[1:] for c in batch]
        assert [t for c in chunks for t in c.new_token_ids] == list(range(200)) and chunks[-1].finished
        gaps = [b - a for a, b in zip(stamps[2:], stamps[3:-1])]
        assert gaps and all(g >= 0.2 * 0.9 for g in gaps), gaps  # 4 streams / 20 per s


def test_an_engine_waiting_on_other_threads_is_polled_not_spun():
    """Work left but nothing to step (a grammar compiling elsewhere): steps without output
    are spaced by ``IDLE_POLL_S`` instead of spinning the engine thread."""

    class Compiling(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.until = time.monotonic() + 0.2

        def has_unfinished(self) -> bool:
            return time.monotonic() < self.until

        def step(self):
            self.steps += 1
            return []

    async def go():
        engine = Compiling()
        loop = await EngineLoop.create(lambda: engine)
        await asyncio.sleep(0.3)
        await loop.shutdown()
        return engine.steps

    steps = run(go())
    assert 2 <= steps <= 0.2 / IDLE_POLL_S + 50, steps  # a spin makes ~10^5


class RecordingFetcher:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def prefetch(self, loop: EngineLoop, token_ids: list[int]) -> str:
        self.prompts.append(list(token_ids))
        return "none"


def test_the_store_is_not_asked_for_prompts_that_read_no_cache():
    """A choice that wants prompt_logprobs computes every prompt position: a fetch for a
    request of only such choices would move a checkpoint nobody reads."""

    async def go():
        fetcher = RecordingFetcher()
        loop = await EngineLoop.create(lambda: FakeEngine())
        core = ReplicaCore(loop, load_config(), fetcher=fetcher)
        logprobs = SamplingParams(max_tokens=1, prompt_logprobs=0)
        await collect(core, GenerateRequest("a", [1, 2], [logprobs]))
        await collect(core, GenerateRequest("b", [3, 4], [logprobs, SamplingParams(max_tokens=1)]))
        await collect(core, GenerateRequest("c", [5, 6], [SamplingParams(max_tokens=1)]))
        await loop.shutdown()
        return fetcher.prompts

    assert run(go()) == [[3, 4], [5, 6]]


class FailingOnceEngine(FakeEngine):
    """At step ``fail_at``, ends ``victim`` as the engine's recovery does and raises StepFailed;
    with ``always`` every step from then on fails that way."""

    def __init__(self, victim: str, fail_at: int, always: bool = False) -> None:
        super().__init__(step_s=0.002)
        self.victim, self.fail_at, self.always = victim, fail_at, always

    def step(self) -> list[EngineOutput]:
        if self.steps + 1 >= self.fail_at and (self.always or self.steps + 1 == self.fail_at):
            self.steps += 1
            victims = [rid for rid in self.live if rid.startswith(self.victim)]
            ended = [self._out(rid, True, "abort") for rid in victims]
            for rid in victims:
                del self.live[rid]
            raise StepFailed(RuntimeError("kernel exploded"), ended)
        return super().step()


def test_a_failed_step_fails_its_requests_and_the_replica_goes_on():
    async def go():
        engine = FailingOnceEngine("bad", fail_at=3)
        core = ReplicaCore(await EngineLoop.create(lambda: engine), load_config())
        good = asyncio.create_task(collect(core, GenerateRequest("good", [1], [SamplingParams(max_tokens=8)])))
        with pytest.raises(EngineLoopError, match="kernel exploded"):
            await collect(core, GenerateRequest("bad", [1], [SamplingParams(max_tokens=8)]))
        items = await good
        core.check_health()  # healthy: one failed step is not fatal
        after = await collect(core, GenerateRequest("after", [1], [SamplingParams(max_tokens=2)]))
        await core.shutdown()
        return items, after

    items, after = run(go())
    chunks = [c for batch in items[1:] for c in batch]
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert [c for batch in after[1:] for c in batch][-1].finish_reason == "length"


def test_failed_steps_in_a_row_are_fatal():
    async def go():
        engine = FailingOnceEngine("x", fail_at=2, always=True)
        core = ReplicaCore(await EngineLoop.create(lambda: engine), load_config())
        with pytest.raises(EngineLoopError):
            await collect(core, GenerateRequest("x", [1], [SamplingParams(max_tokens=50)]))
        other = asyncio.create_task(collect(core, GenerateRequest("y", [1], [SamplingParams(max_tokens=50)])))
        with pytest.raises(EngineLoopError):
            await other
        with pytest.raises(RuntimeError, match="kernel exploded"):
            core.check_health()
        await core.shutdown()

    run(go())


def test_a_stop_string_found_off_the_engine_thread_ends_the_request_in_the_engine():
    """Text is made on the event loop's thread; a stop string met there cuts the choice at
    its token and ends the request in the engine by a queued call (one other choice runs on)."""

    async def go():
        engine = FakeEngine(step_s=0.002)
        core = ReplicaCore(await EngineLoop.create(lambda: engine), load_config())
        params = [SamplingParams(max_tokens=20, stop=["xxx"]), SamplingParams(max_tokens=6)]
        items = await collect(core, GenerateRequest("r", [1], params))
        await core.shutdown()
        return engine, items

    engine, items = run(go())
    chunks = [c for batch in items[1:] for c in batch]
    stopped = [c for c in chunks if c.index == 0]
    assert [t for c in stopped for t in c.new_token_ids] == [0, 1, 2]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == "xxx"
    assert "".join(c.delta_text for c in stopped) == ""
    other = [c for c in chunks if c.index == 1]
    assert [t for c in other for t in c.new_token_ids] == list(range(6))
    assert other[-1].finish_reason == "length"
    assert engine.stopped == ["r-0"] and engine.live == {}
