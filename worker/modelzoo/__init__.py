"""The project's own tiny checkpoints: tokenizer, base models and LoRA adapters, built offline.

Entry points live in `worker.modelzoo.make` (`make_all`, `ensure_zoo`, `ZooPaths`).
"""
