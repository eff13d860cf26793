"""The response cache's notion of "the same request" and the saturation page parser, without
servers (the end-to-end checks are in tests/test_gateway_under_load.py)."""

from __future__ import annotations

from kvserve.gateway.cache_keys import bucket_key, conversation_text, exact_key, guard
from kvserve.gateway.response_cache import cacheable
from kvserve.gateway.saturation import parse_saturation
from kvserve.metrics.saturation import saturation

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 4}


def test_exact_key_ignores_transport_and_keeps_what_changes_the_answer():
    k = exact_key("m", "/chat/completions", BODY)
    assert k == exact_key("m", "/chat/completions", {**BODY, "user": "u", "stream": False, "model": "other"})
    for change in ({"max_tokens": 5}, {"tools": [{"type": "function"}]}, {"seed": 1},
                   {"messages": [{"role": "system", "content": "hi"}]}):  # fmt: skip
        assert exact_key("m", "/chat/completions", {**BODY, **change}) != k
    assert exact_key("n", "/chat/completions", BODY) != k and exact_key("m", "/completions", BODY) != k


def test_a_lone_surrogate_has_a_key():
    """Valid JSON ("\\ud800") but not encodable as UTF-8: the key's digest raised (a 500)."""
    body = {**BODY, "messages": [{"role": "user", "content": "a \ud800"}]}
    assert exact_key("m", "/p", body) != exact_key("m", "/p", BODY)


def test_bucket_is_everything_but_the_text_and_text_is_the_whole_conversation():
    other = {**BODY, "messages": [{"role": "user", "content": "hello there"}]}
    assert bucket_key("m", "/p", BODY) == bucket_key("m", "/p", other)
    longer = {**BODY, "messages": [{"role": "user", "content": "a"}, *BODY["messages"]]}
    assert bucket_key("m", "/p", longer) != bucket_key("m", "/p", BODY)  # roles differ
    assert conversation_text(longer) == "user: a\nuser: hi"


def test_guard_separates_negations_and_numbers():
    assert guard("Is it safe to swim?") == guard("is it SAFE to swim ?")
    for a, b in [("Is it safe?", "Is it not safe?"), ("Can I go?", "Can't I go?"), ("fee", "no fee"),
                 ("take 2", "take 20"), ("with sugar", "without sugar"), ("ever", "never")]:  # fmt: skip
        assert guard(a) != guard(b), (a, b)


def test_only_greedy_unstreamed_requests_are_cacheable_by_default():
    assert cacheable(BODY, False) and not cacheable({**BODY, "stream": True}, True)
    assert not cacheable({**BODY, "temperature": 0.5}, False) and cacheable(
        {**BODY, "temperature": 0.5}, True
    )
    assert not cacheable({"messages": []}, False)  # no temperature: OpenAI's default is 1


def test_saturation_formula_and_page_parsing():
    assert saturation(0, 0, 0.0, 8) == 0 and saturation(4, 0, 0.25, 8) == 0.5
    assert saturation(8, 4, 0.3, 8) == 1.5 and saturation(2, 0, 0.9, 8) == 0.9
    one = '# TYPE kvserve:saturation gauge\nkvserve:saturation{model_name="m"} 0.75\n'
    dp = ('# TYPE kvserve:saturation gauge\nkvserve:saturation{engine="0",model_name="m"} 1.0\n'
          'kvserve:saturation{engine="total",model_name="m"} 0.5\n')  # fmt: skip
    assert parse_saturation(one) == 0.75 and parse_saturation(dp) == 0.5
    assert parse_saturation("# nothing here\n") is None


def test_a_page_that_is_not_prometheus_text_is_no_reading():
    """A backend answering /metrics with a page that is not Prometheus text (an HTML page, a
    bad value) raised ValueError out of the gateway's whole poll, so every group's saturation
    stayed frozen at its last reading. It is now no reading for that backend alone; so is a
    gauge that is not a finite number (a mean with NaN in it never degraded)."""
    assert parse_saturation("<html><body>Not here</body></html>") is None
    assert parse_saturation("# TYPE kvserve:saturation gauge\nkvserve:saturation abc\n") is None
    assert parse_saturation("# TYPE kvserve:saturation gauge\nkvserve:saturation NaN\n") is None
