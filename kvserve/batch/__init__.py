"""OpenAI's Batch API: files, batch jobs in SQLite, and the runner that feeds a bounded window
of a file's requests to the engine at background priority (docs/BATCH.md)."""
