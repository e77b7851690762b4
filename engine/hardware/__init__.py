"""The machine (pure Python): GPUs read live through NVML (``devices``), simulated rigs
(``rigs``) and the measured runtime overhead per GPU (``calibration``)."""
