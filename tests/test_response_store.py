"""The Responses API store (response_store.py): bounded, least recently used dropped first, and
with `--response-store sqlite:PATH` a conversation that survives a server restart."""

from __future__ import annotations

import json
import sqlite3

import openai
import pytest
from server_utils import ServerProcess

from kvserve.entrypoints.openai.response_store import (
    ItemNotFoundError,
    MemoryResponseStore,
    ResponseNotFoundError,
    SQLiteResponseStore,
    open_store,
)
from kvserve.entrypoints.openai.responses_items import chain_items


def _resp(i: int) -> dict:
    return {"id": f"resp_{i}", "object": "response", "output": [{"type": "message", "text": f"é {i}"}]}


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_bounded_least_recently_used_first(tmp_path, kind):
    store = open_store("memory" if kind == "memory" else f"sqlite:{tmp_path / 'r.db'}", capacity=3)
    for i in range(3):
        store.put(_resp(i), [{"role": "user", "content": f"q{i}"}])
    assert store.get("resp_0")[1] == [{"role": "user", "content": "q0"}]  # now the most recent
    store.put(_resp(3), [])
    with pytest.raises(ResponseNotFoundError):
        store.get("resp_1")  # the least recently used went
    assert [store.get(f"resp_{i}")[0] for i in (0, 2, 3)] == [_resp(0), _resp(2), _resp(3)]
    store.delete("resp_2")
    with pytest.raises(ResponseNotFoundError):
        store.delete("resp_2")


def test_sqlite_store_reopens_with_its_contents_and_order(tmp_path):
    path = str(tmp_path / "r.db")
    first = SQLiteResponseStore(path, capacity=2)
    first.put(_resp(0), [{"role": "user", "content": "hi"}])
    first.put(_resp(1), [])
    first.get("resp_0")
    first.close()
    again = SQLiteResponseStore(path, capacity=2)
    assert again.get("resp_0") == (_resp(0), [{"role": "user", "content": "hi"}])
    again.put(_resp(2), [])  # resp_1 was the least recently used before the restart
    with pytest.raises(ResponseNotFoundError):
        again.get("resp_1")


def test_input_items_are_kept_and_an_older_sqlite_file_gains_them(tmp_path):
    """A file written before input items were kept opens, its responses listing none."""
    path = str(tmp_path / "old.db")
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, used INTEGER NOT NULL, "
                "response TEXT NOT NULL, conversation TEXT NOT NULL)")  # fmt: skip
    old.execute("INSERT INTO responses VALUES ('resp_0', 1, ?, '[]')", (json.dumps(_resp(0)),))
    old.commit()
    old.close()
    store = SQLiteResponseStore(path)
    assert store.input_items("resp_0") == [] and store.get("resp_0") == (_resp(0), [])
    for kept in (store, MemoryResponseStore()):
        kept.put(_resp(1), [], [{"id": "msg_1", "type": "message"}])
        assert kept.input_items("resp_1") == [{"id": "msg_1", "type": "message"}]
        with pytest.raises(ResponseNotFoundError):
            kept.input_items("resp_9")


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_items_are_found_by_id_while_their_response_is_kept(tmp_path, kind):
    """item_reference names an input or output item of a stored response; it goes with the
    response (dropped or deleted), and a later response holding it keeps it findable."""
    path = tmp_path / "r.db"
    store = open_store("memory" if kind == "memory" else f"sqlite:{path}", capacity=2)
    said = {"id": "msg_in", "type": "message", "role": "user", "content": "q"}
    store.put(_resp(0) | {"output": [{"id": "msg_out", "type": "message"}]}, [], [said])
    assert store.item("msg_in") == said and store.item("msg_out") == {"id": "msg_out", "type": "message"}
    store.put(_resp(1), [], [said])  # passed back to a later response
    store.delete("resp_0")
    assert store.item("msg_in") == said
    with pytest.raises(ItemNotFoundError):
        store.item("msg_out")
    if kind == "sqlite":
        store.close()
        store = SQLiteResponseStore(str(path), capacity=2)
        assert store.item("msg_in") == said
    store.put(_resp(2), [])
    store.put(_resp(3), [])  # resp_1 dropped, least recently used
    with pytest.raises(ItemNotFoundError):
        store.item("msg_in")


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_chains_items_are_carried_as_far_back_as_they_are_stored(tmp_path, kind):
    """The duplicate check reads every response of a previous_response_id chain (`held`: a
    response and its input items, read without counting as a use), not only the last; a link
    no longer stored ends the walk."""
    store = open_store("memory" if kind == "memory" else f"sqlite:{tmp_path / 'r.db'}", capacity=8)
    for i in range(3):
        prev = {"previous_response_id": f"resp_{i - 1}"} if i else {}
        out = {"output": [{"id": f"msg_out{i}", "type": "message"}]}
        store.put(_resp(i) | prev | out, [], [{"id": f"msg_in{i}", "type": "message"}])
    ids = [i["id"] for i in chain_items("resp_2", store.held)]
    assert ids == ["msg_in2", "msg_out2", "msg_in1", "msg_out1", "msg_in0", "msg_out0"]
    for i in range(3, 8):  # the store full (8)
        store.put(_resp(i), [])
    chain_items("resp_2", store.held)  # a walk is no use: resp_0 is still the least recently used
    store.put(_resp(8), [])
    with pytest.raises(ResponseNotFoundError):
        store.get("resp_0")
    ids = [i["id"] for i in chain_items("resp_2", store.held)]  # as far back as it is stored
    assert ids == ["msg_in2", "msg_out2", "msg_in1", "msg_out1"]


def test_an_sqlite_file_written_before_items_were_indexed_finds_them(tmp_path):
    """Its responses' items were not findable by id: an item_reference to them was refused."""
    path = str(tmp_path / "r.db")
    store = SQLiteResponseStore(path)
    store.put(_resp(0) | {"output": [{"id": "msg_out", "type": "message"}]}, [], [{"id": "msg_in"}])
    store.close()
    old = sqlite3.connect(path)
    old.execute("DROP TABLE items")  # as that version wrote it
    old.commit()
    old.close()
    again = SQLiteResponseStore(path)
    assert again.item("msg_out") == {"id": "msg_out", "type": "message"}
    assert again.item("msg_in") == {"id": "msg_in"}


@pytest.mark.parametrize("spec, size", [("redis://x", 8), ("sqlite:", 8), ("memory", 0)])
def test_bad_store_settings_are_refused(tmp_path, spec, size):
    with pytest.raises(ValueError, match="--response-store"):
        open_store(spec, size)
    assert isinstance(open_store("memory", 1), MemoryResponseStore)
    with pytest.raises(ValueError, match="cannot open"):
        open_store(f"sqlite:{tmp_path}", 8)  # a directory


def test_conversation_survives_a_server_restart(tiny_llama_dir, tmp_path):
    args = ("--kv-cache-memory", "8MiB", "--max-model-len", "256", "--served-model-name", "tiny",
            "--response-store", f"sqlite:{tmp_path / 'responses.db'}")  # fmt: skip
    kw = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}
    s = ServerProcess(tiny_llama_dir, *args)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=s.api_key, max_retries=0)
        first = client.responses.create(**kw, input="Hello world!")
    finally:
        s.stop()
    s = ServerProcess(tiny_llama_dir, *args)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=s.api_key, max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(**kw, input="The quick brown fox", previous_response_id=first.id)
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    finally:
        s.stop()
