"""OpenAI-facing layer: tokenizer, V4.1 prompt encoding, output parsers, detokenizer, server."""
