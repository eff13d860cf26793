"""A batch whose completion window ends before its lines do: every line not done yet gets an
error line with code `batch_expired`, as OpenAI writes them, so each input line is in the
output or the error file (found again by its custom_id) and completed + failed = total."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvserve.batch.lines import LineError, error_record
from kvserve.batch.output import DurableSink
from kvserve.batch.validate import custom_id_of

MESSAGE = "This request could not be executed before the completion window expired."
YIELD_EVERY = 1000  # lines between commits and a turn of the event loop (a file can be 200 MB)


async def expire_rest(path: str | Path, sink: DurableSink, line: int = 0, offset: int = 0) -> None:
    """Write the batch_expired line of each line from `line` (at byte `offset`) not yet done;
    committed as it goes, so a restart mid-way neither repeats nor loses one."""
    with open(path, "rb") as f:
        f.seek(offset)
        while raw := f.readline():
            end = f.tell()
            if sink.is_done(line) or not raw.strip():
                sink.add(line, end, None, True)
            else:
                err = LineError(MESSAGE, "batch_expired", custom_id_of(raw))
                sink.add(line, end, error_record(err), False)
            line += 1
            if line % YIELD_EVERY == 0:
                sink.commit()
                await asyncio.sleep(0)
    sink.commit()
