"""Where stored Responses live (store=true, read back by previous_response_id and GET).

`memory` (the default) is lost on restart; `sqlite:PATH` keeps them in one SQLite file, so a
conversation survives a restart or a redeploy onto the same disk. Both are bounded: past
`capacity` the least recently used response is dropped, so an unattended server never
grows without limit. Each keeps its items (input and output) findable by id, for the
`item_reference` input items that name them; they go with their response.
"""

from __future__ import annotations

import json
import sqlite3
from collections import OrderedDict
from typing import Protocol


class ResponseNotFoundError(LookupError):
    """An id that is not (or no longer) in the store: 404."""


class PreviousResponseNotFoundError(ValueError):
    """previous_response_id names no stored response: a 400 with OpenAI's code for it,
    `previous_response_not_found`, which clients (Codex, proxies in front of it) read to resend
    the whole conversation instead."""


class ItemNotFoundError(LookupError):
    """An item id that no stored response holds."""


def _items_of(response: dict, input_items: list[dict]) -> list[dict]:
    """The items a response holds, as item_reference finds them: its input, then its output."""
    return [i for i in [*input_items, *response.get("output", [])] if isinstance(i.get("id"), str)]


def _missing(response_id: str) -> ResponseNotFoundError:
    return ResponseNotFoundError(f"response {response_id!r} not found (never stored, or expired)")


class ResponseStore(Protocol):
    """Responses by id, each with the conversation it ended on (chat messages) and the input
    items the request sent (as GET /v1/responses/{id}/input_items lists them)."""

    def put(self, response: dict, conversation: list[dict], input_items: list[dict] | None = None) -> None:
        """`input_items`: stored_input_items of the request (none: an empty list)."""

    def get(self, response_id: str) -> tuple[dict, list[dict]]: ...

    def input_items(self, response_id: str) -> list[dict]: ...

    def held(self, response_id: str) -> tuple[dict, list[dict]]:
        """The response and its input items, without the conversation (to walk a chain); read
        without counting as a use (a long chain walked each turn was a write per link)."""

    def item(self, item_id: str) -> dict:
        """An input or output item of a stored response, by its id; ItemNotFoundError if none."""

    def delete(self, response_id: str) -> None: ...


class MemoryResponseStore:
    """In this process only; at most `capacity`, LRU."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict], list[dict]]] = OrderedDict()
        self._by_item: dict[str, tuple[str, dict]] = {}  # item id -> (its response's id, the item)

    def put(self, response: dict, conversation: list[dict], input_items: list[dict] | None = None) -> None:
        if response["id"] in self._items:  # replaced: its former items go
            self._drop(response["id"])
        self._items[response["id"]] = (response, conversation, input_items or [])
        self._items.move_to_end(response["id"])
        for item in _items_of(response, input_items or []):
            self._by_item[item["id"]] = (response["id"], item)
        while len(self._items) > self.capacity:
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        response, _, input_items = self._items.pop(response_id)
        for item in _items_of(response, input_items):
            if self._by_item.get(item["id"], ("",))[0] == response_id:  # (a later response may hold it too)
                del self._by_item[item["id"]]

    def _row(self, response_id: str) -> tuple[dict, list[dict], list[dict]]:
        if response_id not in self._items:
            raise _missing(response_id)
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        return self._row(response_id)[:2]

    def input_items(self, response_id: str) -> list[dict]:
        return self._row(response_id)[2]

    def held(self, response_id: str) -> tuple[dict, list[dict]]:
        if response_id not in self._items:
            raise _missing(response_id)
        response, _, input_items = self._items[response_id]
        return response, input_items

    def item(self, item_id: str) -> dict:
        if item_id not in self._by_item:
            raise ItemNotFoundError(item_id)
        return self._by_item[item_id][1]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)


class SQLiteResponseStore:
    """One SQLite file; at most `capacity` rows, LRU by a use counter kept in the rows (so the
    order survives a restart too). Each call is one short local transaction; the handlers call
    it on the event loop, as the memory store, since a row is a few kilobytes."""

    def __init__(self, path: str, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._db = sqlite3.connect(path, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, used INTEGER NOT NULL, "
            "response TEXT NOT NULL, conversation TEXT NOT NULL)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS responses_by_use ON responses (used)")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
        if "input_items" not in columns:  # a file written before input items were kept
            self._db.execute("ALTER TABLE responses ADD COLUMN input_items TEXT NOT NULL DEFAULT '[]'")
        indexed = self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'items'")
        if indexed.fetchone() is None:  # new, or a file written before items were found by id
            self._db.execute(
                "CREATE TABLE items (id TEXT PRIMARY KEY, response_id TEXT NOT NULL, item TEXT NOT NULL)"
            )
            self._db.execute("CREATE INDEX items_by_response ON items (response_id)")
            rows = self._db.execute("SELECT id, response, input_items FROM responses ORDER BY used")
            for rid, response, input_items in rows.fetchall():
                self._index(rid, json.loads(response), json.loads(input_items))
        self._db.commit()
        (self._clock,) = self._db.execute("SELECT COALESCE(MAX(used), 0) FROM responses").fetchone()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def put(self, response: dict, conversation: list[dict], input_items: list[dict] | None = None) -> None:
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO responses (id, used, response, conversation, input_items) "
                "VALUES (?, ?, ?, ?, ?)",
                (response["id"], self._tick(), json.dumps(response), json.dumps(conversation),
                 json.dumps(input_items or [])),
            )  # fmt: skip
            self._db.execute("DELETE FROM items WHERE response_id = ?", (response["id"],))
            self._index(response["id"], response, input_items or [])
            gone = self._db.execute(
                "DELETE FROM responses WHERE used <= "
                "(SELECT used FROM responses ORDER BY used DESC LIMIT 1 OFFSET ?) RETURNING id",
                (self.capacity,),
            ).fetchall()
            self._db.executemany("DELETE FROM items WHERE response_id = ?", gone)

    def _index(self, response_id: str, response: dict, input_items: list[dict]) -> None:
        self._db.executemany(
            "INSERT OR REPLACE INTO items (id, response_id, item) VALUES (?, ?, ?)",
            [(i["id"], response_id, json.dumps(i)) for i in _items_of(response, input_items)],
        )

    def _read(self, response_id: str, columns: str, use: bool = True) -> tuple:
        row = self._db.execute(f"SELECT {columns} FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            raise _missing(response_id)
        if not use:
            return tuple(json.loads(v) for v in row)
        with self._db:
            self._db.execute("UPDATE responses SET used = ? WHERE id = ?", (self._tick(), response_id))
        return tuple(json.loads(v) for v in row)

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        response, conversation = self._read(response_id, "response, conversation")
        return response, conversation

    def input_items(self, response_id: str) -> list[dict]:
        return self._read(response_id, "input_items")[0]

    def held(self, response_id: str) -> tuple[dict, list[dict]]:
        response, input_items = self._read(response_id, "response, input_items", use=False)
        return response, input_items

    def item(self, item_id: str) -> dict:
        row = self._db.execute("SELECT item FROM items WHERE id = ?", (item_id,)).fetchone()
        if row is None:
            raise ItemNotFoundError(item_id)
        return json.loads(row[0])

    def delete(self, response_id: str) -> None:
        with self._db:
            gone = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount
            self._db.execute("DELETE FROM items WHERE response_id = ?", (response_id,))
        if gone == 0:
            raise _missing(response_id)

    def close(self) -> None:
        self._db.close()


def open_store(spec: str, capacity: int) -> MemoryResponseStore | SQLiteResponseStore:
    """`memory` or `sqlite:PATH` (the --response-store flag); ValueError for anything else."""
    if capacity < 1:
        raise ValueError(f"--response-store-size: must be at least 1 (got {capacity})")
    if spec == "memory":
        return MemoryResponseStore(capacity)
    kind, _, path = spec.partition(":")
    if kind != "sqlite" or not path:
        raise ValueError(f"--response-store: expected memory or sqlite:PATH, got {spec!r}")
    try:
        return SQLiteResponseStore(path, capacity)
    except sqlite3.Error as e:
        raise ValueError(f"--response-store: cannot open {path!r} as SQLite: {e}") from None
