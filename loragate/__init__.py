"""loragate: shared, torch-free core (CLI, block hashing, cross-process types)."""
