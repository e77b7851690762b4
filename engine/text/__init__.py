"""Text (pure Python): the tokenizer with its BPE and SentencePiece halves and chat templates."""
