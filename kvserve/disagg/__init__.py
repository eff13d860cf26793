"""`kvserve pd-proxy`: one OpenAI endpoint over a prefill engine and a decode engine
(docs/DISAGGREGATION.md). split.py: the two bodies a request becomes; proxy.py: the app."""
