"""Run directories: run.json manifest, metrics.jsonl events and the tools that read them."""
