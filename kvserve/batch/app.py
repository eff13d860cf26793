"""What the API server adds for batches: the stores, the worker and the routes, built once."""

from __future__ import annotations

from kvserve.batch.db import default_storage_dir, open_db
from kvserve.batch.files import FileStore
from kvserve.batch.jobs import JobStore
from kvserve.batch.routes import MULTIPART_SLACK, batch_router
from kvserve.batch.service import BatchService


class BatchAPI:
    def __init__(self, serving, cfg, max_num_seqs: int, draining=lambda: False, responses=None) -> None:
        storage = cfg.batch_storage_dir or default_storage_dir()
        conn = open_db(storage)
        self.files = FileStore(conn, storage, cfg.max_upload_size)
        self.jobs = JobStore(conn)
        self.service = BatchService(
            self.files, self.jobs, serving, cfg.batch_window or max_num_seqs, draining, responses
        )
        self.router = batch_router(self.files, self.jobs, self.service)
        # Uploads past the limit get a 400 naming `file` from the route (by the declared length,
        # or while copying); the middleware stops only a chunked body that runs past it (413).
        self.body_limits = {"/v1/files": cfg.max_upload_size + MULTIPART_SLACK}

    def start(self) -> None:
        self.service.start()

    async def stop(self) -> None:
        await self.service.stop()
        self.jobs.conn.close()
