"""Real models: pulled from a public package index once, verified, and converted for the engine."""
