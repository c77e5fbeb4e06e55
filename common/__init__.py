"""Small stdlib-only helpers shared by the app, the trainer, the benches and the tests (no Django, no torch)."""
