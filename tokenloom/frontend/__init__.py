"""Front-end processes: tokenizer manager (engine/server process) and detokenizer."""
