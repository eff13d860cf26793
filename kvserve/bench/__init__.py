"""`kvserve bench`: a serving load generator for any OpenAI-compatible server, sweeps with
latency-throughput plots, and offline engine throughput, all on the same synthetic datasets."""
