"""Seeing what a run did: metrics, logs, diagnostics, the HTML report, per-token explanations.

- `metrics`: completion / reward statistics and their reduction over processes.
- `tracking`: metrics.jsonl, completions.jsonl, the config history, TensorBoard, wandb, the console.
- `diagnostics`: common mistakes spotted in the config and the metrics, each said once.
- `report`, `charts`: `grpokit report`, one self-contained HTML page.
- `explain`: `grpokit explain`, one answer's per-token probabilities and ratios.
"""
