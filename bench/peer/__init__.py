"""pdserve against vLLM's CPU build on the same cores (``python -m bench.peer``; bench/peer/run.py)."""
