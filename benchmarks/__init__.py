"""Commands that print figures: not installed with Carve, run from a checkout
(``python -m benchmarks.NAME``). benchmarks/README.md lists them."""
