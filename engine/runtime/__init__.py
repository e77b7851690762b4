"""The torch half of the engine: the engine process (``server``), sessions that execute a priced
Layout (``session``, ``loader``), the CPU models (``models``), the GPU runner (``gpu``),
sampling and `carve bench`. Nothing outside ``engine.runtime`` in ``engine`` imports torch."""
