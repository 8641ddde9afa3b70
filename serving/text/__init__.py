"""Text for serving: tokenizer, incremental detokenizer, the V4.1 prompt encoding (below the engine and the API)."""
