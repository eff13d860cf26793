"""Quality evaluation through the engine (`kvserve eval perplexity`)."""
