"""The file format (pure Python): reading GGUF headers and tensor tables (``reader``), writing
GGUF files (``writer``), a model's hyper-parameters (``hparams``) and the models Carve ships
(``demo``)."""
