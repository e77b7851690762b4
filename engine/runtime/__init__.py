"""The engine runtime: executes a priced Layout and runs generation on it."""
