"""The engine tests' shared fixtures (defined beside the engine tests that introduced them)."""

from test_engine import drafter, drafter_dir, loaded, make_engine, reference  # noqa: F401
