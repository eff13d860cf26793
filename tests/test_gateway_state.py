"""The state-store contract, run against both stores (memory, and a real Redis through the Lua
scripts): all-or-nothing admission, slot release, budget reservation -> spend, tpm correction,
reservation expiry, cooldowns."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from gateway_utils import RedisServer

from kvserve.gateway.budget_words import request_refused
from kvserve.gateway.state import Check, open_store
from kvserve.gateway.state.base import period_index, period_start


@pytest.fixture(scope="module")
def redis_url():
    r = RedisServer()
    yield r.url
    r.stop()


@pytest.fixture(params=["memory", "redis"])
def run(request, redis_url):
    """run(scenario): a coroutine function taking a fresh store."""

    def go(scenario):
        async def main():
            store = open_store("memory" if request.param == "memory" else redis_url)
            if request.param == "redis":
                await store.redis.flushdb()
            try:
                return await scenario(store)
            finally:
                await store.close()

        return asyncio.run(main())

    return go


def test_all_or_nothing(run):
    async def scenario(s):
        rpm, par = Check("rpm", "k", 2), Check("parallel", "k", 1)
        assert (await s.admit("a", [rpm, par], 30)).ok
        refused = await s.admit("b", [rpm, par], 30)  # rpm has room, parallel does not
        assert not refused.ok and refused.failed == par
        assert (await s.admit("c", [rpm], 30)).remaining == [0]  # b took nothing from rpm
        await s.settle("a", [rpm, par], [0, 0])
        assert (await s.admit("d", [par], 30)).ok
        over = await s.admit("e", [rpm], 30)
        assert not over.ok and 0 < over.retry_after <= 60

    run(scenario)


def test_a_claim_is_won_once_until_it_expires(run):
    """What charges a finished batch once however many gateways see it (batch_spend.py)."""

    async def scenario(s):
        first = [await s.claim("batch-1", 0.3), await s.claim("batch-1", 0.3), await s.claim("batch-2", 0.3)]
        await asyncio.sleep(0.4)
        return first, await s.claim("batch-1", 30)

    assert run(scenario) == ([True, False, True], True)


def test_rate_windows_say_when_they_are_back_to_their_initial_state(run):
    """The gateway sent x-ratelimit-limit/remaining-* but no x-ratelimit-reset-* (OpenAI's and
    LiteLLM's): each store now says, per rpm / tpm window, when it holds nothing counted (its
    newest second has left the sliding minute), refused requests' window included."""

    async def scenario(s):
        rpm, tpm, par = Check("rpm", "k", 2), Check("tpm", "k", 100, 30), Check("parallel", "k", 5)
        adm = await s.admit("a", [rpm, tpm, par], 30)
        assert adm.ok and len(adm.reset) == 3 and adm.reset[2] == 0
        assert all(59 <= r <= 60 for r in adm.reset[:2]), adm.reset
        assert (await s.admit("b", [rpm], 30)).ok
        over = await s.admit("c", [rpm, tpm], 30)
        assert not over.ok and over.failed == rpm and len(over.reset) == 1 and 58 <= over.reset[0] <= 60

    run(scenario)


def test_budget_reserve_settle_and_expire(run):
    async def scenario(s):
        b = lambda amount: Check("budget", "k", 10.0, amount)  # noqa: E731
        await s.seed_budget(b(0), 0, 0.0)
        assert (await s.admit("a", [b(6.0)], 30)).ok
        assert not (await s.admit("b", [b(6.0)], 30)).ok  # 6 reserved + 6 > 10
        await s.settle("a", [b(6.0)], [1.5])  # it cost less than reserved
        assert (await s.admit("c", [b(8.5)], 30)).ok  # 1.5 spent + 8.5 = 10: exactly fits
        assert not (await s.admit("d", [b(0.01)], 30)).ok
        await s.settle("c", [b(8.5)], [0.0])  # failed: released, nothing spent
        assert (await s.admit("e", [b(8.0)], 0.3)).ok  # a short-lived reservation ...
        await asyncio.sleep(0.6)
        assert (await s.admit("f", [b(8.5)], 30)).ok  # ... that expired

    run(scenario)


def test_a_spent_budget_that_never_resets_is_told_apart_from_one_that_will_admit(run):
    """A budget without budget_duration whose spend left no room for a request answered
    "retry after 1 s", as one waiting for reservations in flight: no retry ever passed. The
    store now says never (inf); reservations in flight stay 1 s, a periodic budget its reset."""

    async def scenario(s):
        b = lambda amount, period=0: Check("budget", "k", 10.0, amount, period)  # noqa: E731
        await s.seed_budget(b(0), 0, 0.0)
        assert (await s.admit("a", [b(6.0)], 30)).ok
        waiting = await s.admit("b", [b(6.0)], 30)  # 6 reserved, not spent: it may settle for less
        assert not waiting.ok and waiting.retry_after == pytest.approx(1.0)
        assert waiting.spent == 0.0  # (the spend alone, LiteLLM's "Current cost")
        await s.settle("a", [b(6.0)], [6.0])
        spent = await s.admit("c", [b(6.0)], 30)
        assert not spent.ok and spent.retry_after == float("inf") and spent.spent == 6.0
        assert request_refused(spent, "app", None) == (
            "Budget has been exceeded! Key=app Current cost: 6.0, Max budget: 10.0; this request may cost "
            "up to 6, and the budget does not reset (no budget_duration): no retry admits it"
        )
        assert (await s.admit("d", [b(4.0)], 30)).ok  # what is left still admits a cheaper one
        day = Check("budget", "team:red", 10.0, 6.0, 86400)
        adm = await s.admit("e", [day], 30)
        await s.seed_budget(day, period_index(adm.now, 86400), 9.0)
        periodic = await s.admit("f", [day], 30)
        assert not periodic.ok and 0 < periodic.retry_after <= 86400  # until the period's end
        assert request_refused(periodic, "app", 7) == (
            "Budget has been exceeded! Team=red Current cost: 9.0, Max budget: 10.0; this request may cost "
            "up to 6; the budget resets in 7 s (budget_duration)"
        )

    run(scenario)


def _starts(ts: float, period: float) -> datetime:
    return datetime.fromtimestamp(period_start(period_index(ts, period), period), UTC)


def test_budget_periods_reset_on_litellms_calendar_boundaries():
    """Budgets reset on multiples of their period since 1970: a `7d` budget on Thursdays and a
    `30d` one every 30 days from 1970-01-01 (on 2026-12-03, not the 1st), where LiteLLM resets
    `7d` on Mondays and `30d` on the 1st of each month. Now as LiteLLM (UTC); `1d` at 00:00
    and `1h` on the hour as before."""
    now = datetime(2026, 12, 7, 15, 30, tzinfo=UTC).timestamp()  # a Monday
    assert _starts(now, 86400) == datetime(2026, 12, 7, tzinfo=UTC)
    assert _starts(now, 7 * 86400) == datetime(2026, 12, 7, tzinfo=UTC)  # this Monday
    assert _starts(now, 30 * 86400) == datetime(2026, 12, 1, tzinfo=UTC)  # the 1st
    assert _starts(now, 3600) == datetime(2026, 12, 7, 15, tzinfo=UTC)
    jan = datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    assert period_index(jan - 0.001, 30 * 86400) + 1 == period_index(jan, 30 * 86400)  # (ms)
    feb = datetime(2027, 2, 1, tzinfo=UTC).timestamp()
    assert period_start(period_index(jan, 30 * 86400) + 1, 30 * 86400) == feb


def test_redis_counts_budget_periods_as_the_gateway_does(redis_url):
    """The Lua scripts (period.lua) and state/base.py must agree to the millisecond: a gateway's
    rebuild seeds the period the Redis clock is in, and Retry-After is Redis's period end."""
    import redis as sync_redis

    from kvserve.gateway.state import redis_store

    lua = (Path(redis_store.__file__).parent / "period.lua").read_text()
    lua += "local ms, p = tonumber(ARGV[1]), tonumber(ARGV[2])\n"
    lua += "local i = period_index(ms, p)\nreturn {i, period_start(i, p), period_start(i + 1, p)}"
    r = sync_redis.Redis.from_url(redis_url)
    try:
        base = datetime(1999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC).timestamp()
        times = [base + k * 86400 * 7.3 for k in range(0, 1500, 37)] + [base, base + 0.001]
        firsts = [datetime(y, m, 1, tzinfo=UTC).timestamp() for y in (2024, 2100) for m in (1, 2, 3, 12)]
        times += [t + d for t in firsts for d in (-0.001, 0)]
        for period in (3600, 86400, 7 * 86400, 14 * 86400, 30 * 86400, 45 * 86400):
            for t in times:
                ms = int(t * 1000)
                idx = period_index(ms / 1000, period)
                start, end = period_start(idx, period), period_start(idx + 1, period)
                assert r.eval(lua, 0, ms, period * 1000) == [idx, round(start * 1000), round(end * 1000)]
    finally:
        r.close()


def test_a_budget_an_earlier_version_counted_from_the_epoch_is_seeded_again(redis_url):
    """A `30d` budget held in Redis by an earlier version carries an epoch period index: read as
    this version's month index it would be a new period, its spend silently 0. It is reported
    unseeded instead, so the gateway gives it this month's spend from the spend log."""

    async def scenario():
        s = open_store(redis_url)
        await s.redis.flushdb()
        try:
            b, month = Check("budget", "k", 10.0, 2.0, 30 * 86400), 30 * 86400
            now = int((await s.redis.time())[0])
            await s.redis.hset("kvgw:b:k", mapping={"seeded": "1", "period": now // month, "spent": "9.5"})
            adm = await s.admit("a", [b], 30)
            assert not adm.ok and adm.unseeded == 0, adm
            assert await s.seed_budget(b, period_index(adm.now, month), 9.5)
            refused = await s.admit("a", [b], 30)  # 9.5 + 2 > 10: until the 1st of next month
            nxt = period_start(period_index(adm.now, month) + 1, month)
            assert not refused.ok and refused.retry_after == pytest.approx(nxt - adm.now, abs=5)
            assert not await s.seed_budget(b, period_index(adm.now, month), 0.0)  # once
            day = Check("budget", "d", 10.0, 2.0, 86400)  # unchanged periods are not seeded again
            await s.redis.hset("kvgw:b:d", mapping={"seeded": "1", "period": now // 86400, "spent": "1"})
            assert (await s.admit("b", [day], 30)).remaining == [7.0]
        finally:
            await s.redis.flushdb()
            await s.close()

    asyncio.run(scenario())


def test_tpm_is_corrected_by_usage(run):
    async def scenario(s):
        t = lambda n: Check("tpm", "k", 100, n)  # noqa: E731
        assert (await s.admit("a", [t(90)], 30)).ok
        assert not (await s.admit("b", [t(20)], 30)).ok
        await s.settle("a", [t(90)], [30])  # used 30 in the end
        assert (await s.admit("c", [t(70)], 30)).remaining == [0]

    run(scenario)


def test_cooldown_after_allowed_fails(run):
    async def scenario(s):
        assert not await s.record_failure("d1", 3, 60)
        assert not await s.record_failure("d1", 3, 60)
        assert await s.cooling(["d1", "d2"]) == set()
        assert await s.cooldown_left(["d1", "d2"]) == 0
        assert await s.record_failure("d1", 3, 0.4)
        assert await s.cooling(["d1", "d2"]) == {"d1"}
        assert 0 < await s.cooldown_left(["d1", "d2"]) <= 0.4  # when the first comes back
        await asyncio.sleep(0.7)
        assert await s.cooling(["d1"]) == set() and await s.cooldown_left(["d1"]) == 0

    run(scenario)


def test_a_budget_the_store_does_not_hold_is_seeded_once_before_admission(run):
    """A Redis restarted without persistence (or a gateway restarted on the memory store) held
    no budget spend: admission began each key's budget again from 0. A budget the store never
    seeded is now reported (nothing applied) so the gateway can give it its spend from the
    spend log; the first seed wins, and spend settled into that period meanwhile counts."""

    async def scenario(s):
        rpm, b = Check("rpm", "k", 5), lambda amount: Check("budget", "k", 10.0, amount, 3600)  # noqa: E731
        adm = await s.admit("a", [rpm, b(2.0)], 30)
        assert not adm.ok and adm.unseeded == 1 and adm.failed is None and adm.now > 1e9
        period = period_index(adm.now, 3600)
        await s.settle("x", [b(3.0)], [3.0])  # a request admitted before the restart settles after it
        assert await s.seed_budget(b(0), period, 7.0)  # the spend log's 7 (> the 3 settled)
        assert not await s.seed_budget(b(0), period, 0.5)  # another gateway's rebuild: too late
        assert (await s.admit("a", [rpm, b(3.0)], 30)).remaining == [4, 0]  # 7 spent + 3 = 10
        assert not (await s.admit("b", [b(0.5)], 30)).ok
        other = Check("budget", "k2", 10.0, 1.0, 3600)
        await s.settle("y", [other], [4.0])
        assert await s.seed_budget(other, period, 1.0)  # the settled 4 is more than the log's 1
        assert (await s.admit("c", [other], 30)).remaining == [5.0]

    run(scenario)


def test_a_budget_survives_redis_evicting_under_memory_pressure(redis_url):
    """A periodic budget's hash had a TTL (twice its period), so under the shipped manifest's
    maxmemory-policy volatile-lru Redis could evict it like a cached answer once the response
    cache filled its memory: the key's spend this period was forgotten and its budget began
    again. Budget hashes now have no TTL (the period index inside them resets them), so only
    expiring state (cache, windows, reservations) is evicted."""

    async def scenario():
        s = open_store(redis_url)
        await s.redis.flushdb()
        await s.redis.config_set("maxmemory", "4mb")
        await s.redis.config_set("maxmemory-policy", "volatile-lru")
        try:
            b = lambda amount: Check("budget", "k", 10.0, amount, 30 * 86400)  # noqa: E731
            assert (adm := await s.admit("a", [b(9.0)], 30)).unseeded == 0
            await s.seed_budget(b(0), period_index(adm.now, 30 * 86400), 0.0)
            assert (await s.admit("a", [b(9.0)], 30)).ok
            await s.settle("a", [b(9.0)], [9.0])
            for i in range(400):  # ~25 MB of cached answers into 4 MB: Redis evicts
                await s.cache_set(f"answer-{i}", b"x" * 65536, 600)
            assert await s.redis.dbsize() < 400  # (it did evict)
            return (await s.admit("b", [b(2.0)], 30)).ok  # 9 spent + 2 > 10
        finally:
            await s.redis.config_set("maxmemory", "0")
            await s.redis.config_set("maxmemory-policy", "noeviction")
            await s.redis.flushdb()
            await s.close()

    assert asyncio.run(scenario()) is False


def test_tokens_a_request_did_not_use_come_off_its_own_bucket():
    """tpm was corrected in the bucket of the second a request settled in: one admitted at 0
    for 90 tokens that failed at 30 s put -90 in bucket 30, so from 60 s (bucket 0 gone) to
    90 s the window held -90 and admitted 150 tokens against a limit of 100. The unused tokens
    now come off the reservation's own bucket (the store's clock here; Redis's runs
    settle.lua the same way, covered within one window by the test above)."""
    from kvserve.gateway.state.memory import MemoryStore

    now = [0.0]
    s = MemoryStore(clock=lambda: now[0])
    tpm = lambda n: Check("tpm", "k", 100, n)  # noqa: E731

    async def scenario() -> bool:
        assert (await s.admit("a", [tpm(90)], 30)).ok
        now[0] = 30.0
        await s.settle("a", [tpm(90)], [0])  # failed: none of its 90 tokens were used
        now[0] = 61.0
        return (await s.admit("b", [tpm(150)], 30)).ok

    assert asyncio.run(scenario()) is False


def test_the_memory_stores_cached_answers_are_bounded_in_bytes(tmp_path):
    """The memory store kept every cached answer until its TTL (600 s by default): a gateway
    answering many distinct greedy requests grew by each one's size, without a bound. Now
    response_cache.max_bytes bounds them; the least recently used answers go first."""
    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import parse_config
    from kvserve.gateway.state.memory import MemoryStore

    s = MemoryStore(cache_max_bytes=1000)

    async def scenario():
        for i in range(10):
            await s.cache_set(f"k{i}", b"x" * 100, 600)
        assert await s.cache_get("k0") is not None  # (k0 is now the most recently used)
        for i in range(10, 15):
            await s.cache_set(f"k{i}", b"x" * 100, 600)
        kept = [i for i in range(15) if await s.cache_get(f"k{i}") is not None]
        await s.cache_set("huge", b"x" * 1001, 600)
        return kept, await s.cache_get("huge")

    kept, huge = asyncio.run(scenario())
    assert kept == [0, *range(6, 15)] and huge is None
    dep = {"model_name": "m", "backend": {"base_url": "http://x/v1", "model": "m"}}
    cfg = parse_config({"model_list": [dep], "response_cache": {"max_bytes": 4096},
                        "general_settings": {"database": str(tmp_path / "gw.db")}})  # fmt: skip
    assert build_app(cfg, web_ui=False).state.gateway.cache_store.cache_max_bytes == 4096


def test_the_memory_stores_semantic_buckets_count_towards_its_bytes():
    """Semantic-cache buckets (each up to max_entries embeddings, one bucket per model and
    parameter set) were bounded by the TTL alone, outside response_cache.max_bytes. Now
    answers and buckets share that bound, the least recently used going first."""
    from kvserve.gateway.state.memory import MemoryStore

    s = MemoryStore(cache_max_bytes=1000)

    async def scenario():
        for i in range(5):
            await s.cache_set(f"k{i}", b"a" * 100, 600)
        for i in range(10):
            for _ in range(2):  # two 50-byte entries a bucket
                await s.cache_add(f"b{i}", b"e" * 50, 600, max_entries=8)
        answers = [i for i in range(5) if await s.cache_get(f"k{i}") is not None]
        buckets = [i for i in range(10) if await s.cache_entries(f"b{i}")]
        await s.cache_add("huge", b"e" * 1001, 600, max_entries=8)
        return answers, buckets, await s.cache_entries("huge"), s._cache_bytes

    answers, buckets, huge, used = asyncio.run(scenario())
    assert answers == [] and buckets == list(range(10)) and huge == [] and used == 1000


def test_a_budgets_rebuilt_spend_counts_rows_the_spend_log_could_not_write_yet():
    """The spend a lost budget is rebuilt with: the rows written, and this instance's rows a
    failing write (a full disk) left pending; the failed write is no error for the request."""
    import sqlite3

    from kvserve.gateway.spend import SpendLog, SpendRow

    log = SpendLog(sqlite3.connect(":memory:", check_same_thread=False))

    def row(key: str, team: str, cost: float, ts: float = 100.0) -> SpendRow:
        return SpendRow(ts, "r", key, None, team, "m", "d", 1, 1, cost, 200)

    async def scenario():
        log.record(row("k1", "t", 1.5))
        log.record(row("k1", "t", 2.0, ts=10.0))  # before the period
        await log.flush()
        log.db.execute("CREATE TRIGGER full BEFORE INSERT ON spend BEGIN SELECT RAISE(ABORT, 'full'); END")
        log.record(row("k1", "t", 0.25))
        log.record(row("k2", "t", 4.0))
        return await log.spent(50.0, key_hash="k1"), await log.spent(50.0, team="t"), len(log.pending)

    assert asyncio.run(scenario()) == (1.75, 5.75, 2)


@pytest.mark.parametrize(
    "state, cache, warned",
    [
        ("redis://127.0.0.1:1/0", None, True),
        ("redis://127.0.0.1:1/0", "redis://127.0.0.1:1/1", True),  # another db: the same memory
        ("redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", False),
        ("redis://127.0.0.1:1/0", "memory", False),
        ("memory", None, False),
    ],
)
def test_a_cache_on_the_state_stores_redis_server_is_warned_about(tmp_path, caplog, state, cache, warned):
    """A response cache given another db number on the state store's Redis server was taken as
    a Redis of its own (no warning), yet it shares that server's memory and eviction."""
    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import parse_config

    dep = {"model_name": "m", "backend": {"base_url": "http://x/v1", "model": "m"}}
    rc, gs = {"store": cache} if cache else {}, {"state": state, "database": str(tmp_path / "gw.db")}
    cfg = parse_config({"model_list": [dep], "response_cache": rc, "general_settings": gs})
    with caplog.at_level("WARNING", "kvserve.gateway"):
        build_app(cfg, web_ui=False)  # (connects to nothing yet)
    assert ("shares the state store's Redis server" in caplog.text) is warned, caplog.text


def test_a_redis_restart_costs_no_request_its_answer():
    """A pooled connection to a Redis that restarted failed at its next use: every gateway
    request that met one was a 503 state_store_unavailable although Redis was back. The
    command now goes again on a new connection (once, and only after a connection error)."""
    r = RedisServer()

    async def scenario() -> tuple[bool, bool]:
        s = open_store(r.url)
        try:
            rpm = Check("rpm", "k", 100)
            first = (await s.admit("a", [rpm], 30)).ok
            r.restart()
            return first, (await s.admit("b", [rpm], 30)).ok
        finally:
            await s.close()

    try:
        assert asyncio.run(scenario()) == (True, True)
    finally:
        r.stop()


class _ReplyDropper:
    """A TCP proxy to Redis that, once armed, passes the next EVALSHA on and then closes the
    client's connection in place of its reply: the script ran, the client never heard back."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port, self.armed, self.dropped = redis_port, threading.Event(), 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.server.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        upstream, drop = socket.create_connection(("127.0.0.1", self.redis_port)), False
        with client, upstream:
            while True:
                ready, _, _ = select.select([client, upstream], [], [])
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        return
                    if self.armed.is_set() and b"EVALSHA" in data.upper():
                        self.armed.clear()
                        drop = True
                    upstream.sendall(data)
                if upstream in ready:
                    data = upstream.recv(65536)
                    if not data:
                        return
                    if drop:  # the reply is lost with the connection
                        self.dropped += 1
                        return
                    client.sendall(data)

    def close(self) -> None:
        self.server.close()


def test_a_lost_reply_does_not_count_a_request_or_charge_it_twice(redis_url):
    """The store sends a command again after a ConnectionError; one raised after the command
    reached Redis (its reply lost with the connection) ran admit.lua or settle.lua twice: two
    requests in the rpm window, and the budget charged twice for one answer."""
    proxy = _ReplyDropper(int(redis_url.rsplit(":", 1)[1].split("/")[0]))

    async def scenario() -> tuple[float, float]:
        s = open_store(proxy.url)
        try:
            await s.redis.flushdb()
            rpm, budget = Check("rpm", "lost", 100), Check("budget", "lost", 10.0, 1.0)
            await s.seed_budget(budget, 0, 0.0)
            assert (await s.admit("warm", [rpm], 30)).ok  # (the scripts loaded: EVALSHA from here on)
            proxy.armed.set()
            adm = await s.admit("r", [rpm, budget], 30)
            assert adm.ok and adm.remaining[0] == 98 and proxy.dropped == 1
            proxy.armed.set()
            await s.settle("r", [rpm, budget], [0, 1.5])
            assert proxy.dropped == 2
            window = sum(float(v) for v in (await s.redis.hvals("kvgw:w:lost:rpm")))
            return window, float(await s.redis.hget("kvgw:b:lost", "spent"))
        finally:
            await s.close()

    try:
        assert asyncio.run(scenario()) == (2.0, 1.5)
    finally:
        proxy.close()
