"""Planning and pricing (pure Python): what a launch is (``plan``, ``rules``), what each stage
needs (``carve``, ``buffers``), how it is arranged in memory (``arena``, ``layout``), the verdict
(``price``), what would make it fit (``advice``) and the split search (``split``)."""
