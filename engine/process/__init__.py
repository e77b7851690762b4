"""The engine process seen from outside (pure Python): the JSON Lines protocol, the client that
owns a `carve-engine` child, and the sampling settings a generate request carries. The process
itself (``engine.runtime.server``) lives in the torch half."""
