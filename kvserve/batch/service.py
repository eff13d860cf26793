"""The server's batch worker: one batch at a time, oldest first, each through a LineRunner;
picks up unfinished batches when the server starts (resume), and answers cancel requests."""

from __future__ import annotations

import asyncio
import logging
import time

from kvserve.batch.errors import BatchAPIError
from kvserve.batch.execute import execute_line
from kvserve.batch.expired import expire_rest
from kvserve.batch.files import FileStore
from kvserve.batch.jobs import JobStore
from kvserve.batch.output import DurableSink, truncate_uncommitted
from kvserve.batch.runner import LineRunner
from kvserve.batch.validate import duplicate_errors, scan_input

logger = logging.getLogger("kvserve.batch")
CANCELLABLE = ("validating", "in_progress", "cancelling")


class BatchService:
    def __init__(
        self, files: FileStore, jobs: JobStore, serving, window: int, draining=lambda: False, responses=None
    ) -> None:
        """draining: true once the server drains (SIGTERM): batches stop at once, so the drain
        does not wait on them, and resume on the next start. responses: the server's
        ResponsesServing, for /v1/responses batches (their stored responses go to its store)."""
        self.files = files
        self.jobs = jobs
        self.serving = serving
        self.responses = responses
        self.window = window
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._cancelled: set[str] = set()
        self._stopping = False
        self._draining = draining
        self._task: asyncio.Task | None = None
        self._current: str | None = None  # the batch the worker is on

    def start(self) -> None:
        for batch_id in self.jobs.active_ids():
            self._queue.put_nowait(batch_id)
        self._task = asyncio.get_running_loop().create_task(self._work())

    async def stop(self) -> None:
        """Stop at once: lines in flight are aborted, the rest resumes on the next start."""
        self._stopping = True
        self._queue.put_nowait(None)  # wakes an idle worker
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=10)  # it notices within a commit interval
            if not done:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

    def _halted(self) -> bool:
        return self._stopping or self._draining()

    def submit(self, batch_id: str) -> None:
        self._queue.put_nowait(batch_id)

    def cancel(self, batch_id: str) -> dict:
        """A running batch stops at its next check; one the worker is not on (queued behind
        another, never started or resumed after a restart) is cancelled at once, not when the
        worker reaches it. Cancelling one already cancelling returns it as it is; one that is
        finalizing or final can no longer be cancelled."""
        obj = self.jobs.raw(batch_id)
        if obj["status"] not in CANCELLABLE:  # as OpenAI: 409 naming the status
            raise BatchAPIError(
                409, f"batch_id: cannot cancel a batch with status {obj['status']!r}", "batch_id",
                code="batch_not_cancellable",
            )  # fmt: skip
        if obj["status"] in ("validating", "in_progress"):
            obj = self.jobs.set_status(obj, "cancelling")
            if batch_id != self._current:
                self._cut_uncommitted(obj)
                self._finalize(obj)
            else:
                self._cancelled.add(batch_id)
        return self.jobs.get(batch_id)

    async def _work(self) -> None:
        while not self._halted():
            batch_id = await self._queue.get()
            if batch_id is None or self._halted():
                return
            self._current = batch_id
            try:
                await self._process(batch_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug must not stop the worker: fail this batch, go on
                logger.exception("batch %s failed", batch_id)
                obj = self.jobs.raw(batch_id)
                self.jobs.set_status(obj, "failed", errors=_errors("internal_error", str(e)))
            finally:
                self._current = None

    async def _process(self, batch_id: str) -> None:
        obj = self.jobs.raw(batch_id)
        path = self.files.dir / obj["input_file_id"]
        if obj["status"] == "validating":
            try:
                scan, unreadable = await asyncio.to_thread(scan_input, path), None
            except OSError as e:
                scan, unreadable = None, e
            obj = self.jobs.raw(batch_id)  # cancel() may have run while the file was read
            if obj["status"] == "cancelling":  # cancelled first: not failed over it, no line run
                self._finalize(obj)
                return
            if unreadable is not None:
                self._fail_unreadable(obj, unreadable)
                return
            total = scan.total
            if scan.duplicates:  # as OpenAI: the batch fails, each repeat named with its line
                self.jobs.set_status(obj, "failed", errors=duplicate_errors(scan))
                return
            if total == 0:
                errors = _errors("empty_file", "the input file has no lines", "input_file_id")
                self.jobs.set_status(obj, "failed", errors=errors)
                return
            self.jobs.set_total(batch_id, total)
            obj = self.jobs.raw(batch_id)
            if obj["status"] == "validating":
                obj = self.jobs.set_status(obj, "in_progress", model=self._model(scan.model))
        if obj["status"] == "in_progress":
            try:  # a batch resumed after a restart: its input may have been deleted meanwhile
                await asyncio.to_thread(_check_readable, path)
            except OSError as e:
                self._cut_uncommitted(obj)
                self._fail_unreadable(obj, e)
                return
            await self._run(obj)
            obj = self.jobs.raw(batch_id)
        if obj["status"] == "in_progress" and self._expired(obj):
            await self._expire_rest(obj)
            obj = self.jobs.raw(batch_id)  # cancel() may have run meanwhile
        if obj["status"] in ("finalizing", "cancelling") or (
            obj["status"] == "in_progress" and self._expired(obj)
        ):
            self._finalize(obj)

    def _model(self, named: str | None) -> str | None:
        """OpenAI's Batch `model`: the model the lines use. A line that names none runs on the
        default (the first served name); one naming a model not served here fails, so null."""
        names = self.serving.model_names
        model = named or names[0]
        return model if model in names else None

    def _expired(self, obj: dict) -> bool:
        return time.time() > obj["expires_at"]

    async def _run(self, obj: dict) -> None:
        batch_id = obj["id"]
        resume = self.jobs.resume_point(batch_id)
        out, err = self.files.path(obj["_output_path_id"]), self.files.path(obj["_error_path_id"])
        sink = DurableSink(self.jobs.conn, batch_id, out, err, resume)
        wm, off = resume[0], resume[1]

        def should_stop() -> bool:
            return self._halted() or batch_id in self._cancelled or self._expired(obj)

        async def execute(endpoint: str, body: dict, request_id: str):
            return await execute_line(self.serving, endpoint, body, request_id, self.responses)

        try:
            runner = LineRunner(obj["endpoint"], execute, sink, self.window, should_stop, batch_id)
            finished = await runner.run(str(self.files.dir / obj["input_file_id"]), wm, off)
        finally:
            sink.close()
        if finished:
            self.jobs.set_status(self.jobs.raw(batch_id), "finalizing")

    async def _expire_rest(self, obj: dict) -> None:
        """The lines not done when the window ended become batch_expired error lines."""
        resume = self.jobs.resume_point(obj["id"])
        out, err = self.files.path(obj["_output_path_id"]), self.files.path(obj["_error_path_id"])
        sink = DurableSink(self.jobs.conn, obj["id"], out, err, resume)
        try:
            await expire_rest(self.files.dir / obj["input_file_id"], sink, resume[0], resume[1])
        except FileNotFoundError:  # deleted since it was opened: no custom_ids left to name
            logger.warning("batch %s expired; its input file is gone, so no batch_expired lines", obj["id"])
        finally:
            sink.close()

    def _cut_uncommitted(self, obj: dict) -> None:
        """A resumed batch's files may hold lines written after its last commit (a kill -9):
        cut them back as a resume would, so only recorded lines are kept."""
        _, _, out_bytes, err_bytes, _ = self.jobs.resume_point(obj["id"])
        truncate_uncommitted(self.files.path(obj["_output_path_id"]), out_bytes)
        truncate_uncommitted(self.files.path(obj["_error_path_id"]), err_bytes)

    def _fail_unreadable(self, obj: dict, e: OSError) -> None:
        """The batch fails naming its input file; lines it already finished stay readable."""
        why = "it was deleted" if isinstance(e, FileNotFoundError) else e.strerror or type(e).__name__
        message = f"input_file_id: {obj['input_file_id']} cannot be read ({why})"  # not str(e): a server path
        logger.warning("batch %s failed: %s", obj["id"], message)
        self._finalize(obj, "failed", errors=_errors("file_unreadable", message, "input_file_id"))

    def _finalize(self, obj: dict, status: str | None = None, **extra) -> None:
        """Register the output and error files, then the final status, in one transaction."""
        if status is None:
            status = {"finalizing": "completed", "cancelling": "cancelled", "in_progress": "expired"}[
                obj["status"]
            ]
        conn = self.jobs.conn
        conn.execute("BEGIN")
        try:
            fields = dict(extra)
            for key, path_key, name in (("output_file_id", "_output_path_id", "output"),
                                        ("error_file_id", "_error_path_id", "errors")):  # fmt: skip
                file_id = obj[path_key]
                path = self.files.path(file_id)
                if path.exists() and path.stat().st_size > 0:
                    if conn.execute("SELECT 1 FROM files WHERE id = ?", (file_id,)).fetchone() is None:
                        lives = obj.get("_output_expires_after")
                        self.files.register(file_id, f"{obj['id']}_{name}.jsonl", "batch_output", lives)
                    fields[key] = file_id
            self.jobs.set_status(obj, status, **fields)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._cancelled.discard(obj["id"])
        logger.info("batch %s %s: %s", obj["id"], status, self.jobs.get(obj["id"])["request_counts"])


def _check_readable(path) -> None:
    with open(path, "rb"):
        pass


def _errors(code: str, message: str, param: str | None = None) -> dict:
    return {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": None}]}
